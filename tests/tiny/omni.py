"""A tiny Qwen2.5-Omni thinker, built offline, for parity tests against transformers.

The thinker is ``Qwen2_5OmniThinkerForConditionalGeneration`` with random float32
weights: a 2-block Whisper-style audio encoder with 16-frame windows (so that a second of
audio spans several), the Qwen2.5-VL vision tower, and a 2-layer M-RoPE decoder whose
rope θ is not the default. Its tokenizer (``tokenizers`` BPE) carries the Omni special
tokens and the attributes transformers' processor reads (``tokenizer.audio_token`` ...).

Two layouts:

``"transformers"``
    The thinker alone as transformers 5 saves it: ``model_type: qwen2_5_omni_thinker``,
    tensors named by the module tree (``model.audio_tower.*``, ``model.visual.*``,
    ``model.language_model.*``, ``lm_head.*``), the processor's settings nested in
    ``processor_config.json``, the chat template in ``chat_template.jinja``.
``"hub"``
    The layout of Qwen/Qwen2.5-Omni-*: the full model's config (``model_type:
    qwen2_5_omni`` with ``thinker_config`` in the older spellings: ``rope_scaling`` and
    ``rope_theta``, ``in_chans``), tensors ``thinker.*`` beside speech-output ones
    (``talker.*``, ``token2wav.*``) the thinker must skip, one flat
    ``preprocessor_config.json`` for the image processor and the feature extractor,
    ``chat_template.json`` and the talker's (here empty) ``spk_dict.pt``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors

FAMILIES = ("qwen2_5_omni",)
LAYOUTS = ("transformers", "hub")

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
)
OMNI_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}

# Qwen2.5-Omni's template, shortened: a default system turn, one block per media part.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif part['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif part['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_ROPE_THETA = 5000.0
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112
# Mel frames of padding the feature extractor adds (transformers' default is 30 s).
CHUNK_SECONDS = 10


def build_tokenizer():
    return build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", extra_special_tokens=OMNI_TOKENS,
    )


def build_processor_parts():
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    return (Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
            WhisperFeatureExtractor(feature_size=128, chunk_length=CHUNK_SECONDS,
                                    return_attention_mask=True))


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts, for images, audio
    and text (its video processor needs torchvision)."""
    from transformers import Qwen2_5OmniProcessor

    from mlxvlm.models.processor_utils import image_only

    return image_only(Qwen2_5OmniProcessor)(
        image_processor=tiny.image_processor, video_processor=None,
        feature_extractor=tiny.feature_extractor, tokenizer=tiny.tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def _config(tokenizer):
    from transformers import Qwen2_5OmniThinkerConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA,
                         "mrope_section": [4, 6, 6]},
        initializer_range=INIT_RANGE, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    # Windows of 2x2 merged tokens (56 px); block 0 attends within windows, block 1 fully.
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                  num_heads=2, window_size=56, fullatt_block_indexes=[1],
                  initializer_range=INIT_RANGE)
    # n_window 8: windows of 16 mel frames (0.16 s).
    audio = dict(encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=64, n_window=8, initializer_range=INIT_RANGE)
    return Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio,
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"], audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"], vision_start_token_id=ids["<|vision_bos|>"],
        vision_end_token_id=ids["<|vision_eos|>"], bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        initializer_range=INIT_RANGE, tie_word_embeddings=False,
    )


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2_5OmniThinkerForConditionalGeneration(_config(tokenizer)).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    return omni_tiny(family, model, tokenizer, *build_processor_parts())


def omni_tiny(family, model, tokenizer, image_processor, feature_extractor) -> TinyModel:
    """An omni thinker's ``TinyModel``: generation ids set as the Hub's Qwen tokenizers
    give them, the feature extractor beside the image processor."""
    model.generation_config.bos_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tiny = TinyModel(family, model, tokenizer, image_processor)
    tiny.feature_extractor = feature_extractor
    return tiny


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    weights = {name: value.detach().cpu().numpy() for name, value in tiny.model.state_dict().items()}
    tiny.tokenizer.save_pretrained(directory)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    save_processor_files(tiny, directory, layout, "Qwen2_5OmniProcessor", CHAT_TEMPLATE,
                         MIN_PIXELS, MAX_PIXELS)
    if layout == "hub":
        weights = {_hub_name(name): value for name, value in weights.items()}
        # speech-output tensors the thinker must skip
        weights["talker.codec_head.weight"] = np.zeros((8, 4), np.float32)
        weights["token2wav.code2wav_bigvgan_model.conv_post.weight"] = np.zeros((1, 4, 3), np.float32)
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
        import torch

        torch.save({}, directory / "spk_dict.pt")  # the talker's voices; transformers wants it
    write_safetensors(weights, directory)
    return directory


def save_processor_files(tiny: TinyModel, directory: Path, layout: str, processor_class: str,
                         chat_template: str, min_pixels: int, max_pixels: int,
                         video_processor: dict | None = None) -> None:
    """An omni processor's files: transformers 5's ``processor_config.json`` (its parts
    nested; ``video_processor`` when given) and ``chat_template.jinja``, or the Hub's one
    flat ``preprocessor_config.json`` and ``chat_template.json``."""
    if layout == "transformers":
        processor = {
            "image_processor": tiny.image_processor.to_dict(),
            "feature_extractor": tiny.feature_extractor.to_dict(),
            **({"video_processor": video_processor} if video_processor else {}),
            "processor_class": processor_class,
        }
        (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))
        (directory / "chat_template.jinja").write_text(chat_template)
        return
    preprocessor = {**tiny.image_processor.to_dict(), **tiny.feature_extractor.to_dict(),
                    "min_pixels": min_pixels, "max_pixels": max_pixels,
                    "image_processor_type": "Qwen2VLImageProcessor",
                    "processor_class": processor_class}
    preprocessor.pop("size", None)
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}))


def _hub_name(name: str) -> str:
    """Module name -> the name in Qwen/Qwen2.5-Omni-*'s safetensors."""
    for prefix, legacy in (("model.audio_tower.", "audio_tower."), ("model.visual.", "visual."),
                           ("model.language_model.", "model.")):
        if name.startswith(prefix):
            return "thinker." + legacy + name[len(prefix):]
    return "thinker." + name


def hub_config(thinker: dict) -> dict:
    """transformers 5's thinker config.json -> the Hub's full-model config.json."""
    from transformers import Qwen2_5OmniConfig

    thinker = {k: v for k, v in thinker.items() if k not in ("dtype", "transformers_version")}
    text = dict(thinker["text_config"])
    rope = text.pop("rope_parameters")
    text["rope_scaling"] = {"mrope_section": rope["mrope_section"], "rope_type": "default",
                            "type": "default"}
    text["rope_theta"] = rope["rope_theta"]
    thinker["text_config"] = text
    vision = {k: v for k, v in thinker["vision_config"].items() if k != "rope_parameters"}
    vision.update(in_chans=vision["in_channels"], embed_dim=vision["hidden_size"],
                  spatial_patch_size=vision["patch_size"], tokens_per_second=25)
    thinker["vision_config"] = vision
    full = Qwen2_5OmniConfig(enable_audio_output=False).to_dict()
    full.update(thinker_config=thinker, architectures=["Qwen2_5OmniModel"],
                torch_dtype="float32", transformers_version="4.50.0.dev0")
    full.pop("dtype", None)
    return full
