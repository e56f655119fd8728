"""Build a tiny, randomly initialised Qwen2-VL checkpoint offline, ready to fine-tune.

The checkpoint is in MLX layout (as ``python -m mlxvlm.convert`` writes it), with a
byte-level BPE tokenizer trained on the sentences the model will see (so that each word
is about one token), Qwen's special tokens and a Qwen-style chat template, and the
Qwen2-VL image processor. Nothing is downloaded; torch is not needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 400):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus), trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIAL_TOKENS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        errors="replace",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 2,
                 vision_width: int = 32, vision_depth: int = 2, vision_heads: int = 2,
                 patch_size: int = 14) -> dict:
    """A Qwen2-VL config.json (transformers 5's layout) for a model this small."""
    from transformers import Qwen2VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    head_dim = 32
    text = dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        # head_dim / 2 rotary frequencies over (temporal, height, width)
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [4, 6, 6]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(depth=vision_depth, embed_dim=vision_width, hidden_size=hidden_size,
                  num_heads=vision_heads, mlp_ratio=2, patch_size=patch_size)
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    ).to_dict()
    config["eos_token_id"] = ids["<|im_end|>"]
    return config


def redraw_by_name(model, seed: int) -> None:
    """Give every randomly initialised parameter a fresh draw keyed by ``seed`` and its
    own name, uniform with the spread MLX's initialiser gave it; constant ones (norm
    scales, zero biases) stay. The weights then depend on the seed and the parameter
    names only, not on the order in which the model's code creates its layers, so a
    refactor of a family leaves the demo's and the tests' random models as they were."""
    import zlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    redrawn = []
    for name, value in tree_flatten(model.parameters()):
        spread = mx.std(value.astype(mx.float32)).item()
        if spread > 0:
            key = mx.random.key(zlib.crc32(f"{seed}:{name}".encode()))
            half_width = spread * 3**0.5  # a uniform on [-a, a] has std a / sqrt(3)
            value = mx.random.uniform(-half_width, half_width, value.shape, key=key).astype(value.dtype)
        redrawn.append((name, value))
    model.update(tree_unflatten(redrawn))
    mx.eval(model.parameters())


def build_checkpoint(directory: str | Path, corpus: Iterable[str], *, seed: int = 0,
                     image_size: int = 56, pixels: int | None = None, **sizes) -> Path:
    """Write a random tiny Qwen2-VL into ``directory``. Its image processor resizes every
    picture to about ``pixels`` pixels (default ``image_size`` squared), keeping the
    aspect ratio with sides rounded to multiples of two patches (Qwen2-VL's
    ``smart_resize``): with the default 14-pixel patches a square one of ``image_size``
    becomes (image_size / 28)^2 tokens, a 448 x 64 one a strip of tokens."""
    import mlx.core as mx

    from mlxvlm.convert import write_config, write_weights
    from mlxvlm.models import get_family

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus)
    config = build_config(tokenizer, **sizes)
    mx.random.seed(seed)
    model = get_family("qwen2_vl").Model.from_config(config)
    redraw_by_name(model, seed)
    write_weights(model, directory)
    write_config(config, directory)
    tokenizer.save_pretrained(directory)
    write_image_processor(directory, pixels or image_size * image_size,
                          config["vision_config"]["patch_size"])
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory


def write_image_processor(directory: str | Path, pixels: int, patch_size: int) -> None:
    """The Qwen2-VL image processor resizing every picture to about ``pixels`` pixels,
    larger or smaller, keeping its aspect ratio (``smart_resize``)."""
    from transformers import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels,
                             patch_size=patch_size).save_pretrained(directory)
