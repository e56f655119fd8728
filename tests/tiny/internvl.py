"""Tiny InternVL checkpoints (transformers' native layout, ``model_type: internvl``), built
offline (see tests/tiny/__init__.py).

``"internvl"``: InternVL3.5's small sizes in shape -- an InternViT-300M-like tower
(LayerNorm, no q/k norm, biased q/k/v) before a Qwen3 text model with a tied head.
``"internvl_rms"``: the InternViT-6B-like tower of the largest sizes (RMSNorm blocks,
q/k RMSNorm across all heads, unbiased q/k/v) before the same text model.
``"internvl3"``: InternVL3's -hf checkpoints in shape -- the small tower before a Qwen2
text model (biased q/k/v) with an untied output head.
``"internvl_moe"``: InternVL3.5-30B-A3B-HF in shape -- the small tower before a Qwen3-MoE
text model with an untied head: layer 0 routes each token to 2 of 4 experts (weights
renormalized), layer 1 keeps a dense MLP (``mlp_only_layers``).

The tower takes 32-pixel tiles of 4-pixel patches (8 x 8, a 4 x 4 grid after the pixel
shuffle: 16 tokens a tile); the processor cuts a picture into 1 to 4 tiles plus a
thumbnail. The text model's rope theta is far from Qwen3's default.

Layouts:

``"transformers"``
    What transformers 5's ``save_pretrained`` writes for the model and processor.
``"hub"``
    As the Hub's ``OpenGVLab/InternVL3_5-*-HF`` checkpoints are laid out (written by
    transformers 4.5x): the text config with ``rope_theta`` and no ``rope_parameters``,
    ``torch_dtype``, tensors by the module tree (a Qwen3-MoE's experts one tensor each,
    ``mlp.experts.E.gate_proj.weight``, as transformers 4.5x wrote them), ``preprocessor_config.json`` (the fast
    image processor's name), ``video_preprocessor_config.json``, ``processor_config.json``
    with ``image_seq_length`` only, the tokenizer naming its image tokens under
    ``extra_special_tokens``, ``chat_template.jinja``, and sampling settings in
    ``generation_config.json`` (``HUB_SAMPLING``).

The tokenizer, as Qwen's, adds no BOS.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import (
    INIT_RANGE,
    TinyModel,
    build_bpe_tokenizer,
    one_tensor_per_expert,
    perturb_constants,
    write_safetensors,
)

FAMILIES = ("internvl", "internvl_rms", "internvl3", "internvl_moe")
LAYOUTS = ("transformers", "hub")

IMAGE_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>",
    "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>", "<video>",
)

# The -HF checkpoints' template in shape: ChatML, an image part as "<IMG_CONTEXT>\n"
# (which the processor expands to a tile run between <img> and </img>), a video part as
# "<video>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)

TILE = 32
PATCH = 4
TOKENS_PER_TILE = (TILE // PATCH // 2) ** 2
MAX_TILES = 4
ROPE_THETA = 7_000.0  # far from Qwen3's default
# The hub layout's generation_config.json sampling values (the loader's defaults).
HUB_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
IMAGE_SETTINGS = dict(
    size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1,
    max_patches=MAX_TILES, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
)
VIDEO_SETTINGS = dict(
    size={"height": TILE, "width": TILE}, image_mean=[0.485, 0.456, 0.406],
    image_std=[0.229, 0.224, 0.225], initial_shift=True,
)


def build_tokenizer():
    return build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", extra_special_tokens=IMAGE_TOKENS,
    )


def build_image_processor():
    from transformers import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(**IMAGE_SETTINGS)


def reference_processor(tiny: TinyModel):
    """transformers' InternVLProcessor over the tiny model's in-memory parts (no video
    processor: transformers' own needs torchvision)."""
    from transformers import InternVLProcessor

    from mlxvlm.models.processor_utils import image_only

    return image_only(InternVLProcessor)(
        image_processor=tiny.image_processor, tokenizer=tiny.tokenizer, video_processor=None,
        chat_template=CHAT_TEMPLATE, image_seq_length=TOKENS_PER_TILE,
    )


def _config(family: str, tokenizer):
    from transformers import InternVLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    tied = family not in ("internvl3", "internvl_moe")
    text_type = {"internvl3": "qwen2", "internvl_moe": "qwen3_moe"}.get(family, "qwen3")
    text = dict(
        model_type=text_type, vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        initializer_range=INIT_RANGE, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], tie_word_embeddings=tied,
        **({} if text_type == "qwen2" else {"head_dim": 16}),
    )
    if text_type == "qwen3_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    rms = family == "internvl_rms"
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=TILE, patch_size=PATCH, attention_bias=not rms, use_qk_norm=rms,
        norm_type="rms_norm" if rms else "layer_norm", layer_scale_init_value=0.1,
        initializer_range=INIT_RANGE,
    )
    return InternVLConfig(text_config=text, vision_config=vision,
                          image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=TOKENS_PER_TILE,
                          downsample_ratio=0.5, projector_hidden_act="gelu",
                          tie_word_embeddings=tied)


# Picked so that every parity prompt gets 24 greedy tokens with clear top-1/top-2 margins
# and the image prompts' answers vary (the session's seed alone gives one token repeated).
SEED_OFFSET = {"internvl": 6}


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import InternVLForConditionalGeneration

    tokenizer = build_tokenizer()
    seed += SEED_OFFSET.get(family, 0)
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(_config(family, tokenizer)).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():  # layer scale and the table off their constant init
        for name, param in model.named_parameters():
            if name.endswith(("lambda_1", "lambda_2")):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape))
            elif name.endswith(("cls_token", "position_embeddings")):
                param.copy_(0.5 * torch.randn(param.shape))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return TinyModel(family, model, tokenizer, build_image_processor())


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    if layout == "transformers":
        _save_processor(tiny, directory)
    elif layout == "hub":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
        _save_hub_weights(tiny, directory)
        _save_hub_processor_files(tiny, directory)
        generation = json.loads((directory / "generation_config.json").read_text())
        generation.update(do_sample=True, **HUB_SAMPLING)
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    return directory


def _save_processor(tiny: TinyModel, directory: Path) -> None:
    """What InternVLProcessor's save_pretrained writes in transformers 5 (it cannot run
    here without transformers' torchvision video processor): the tokenizer's files,
    chat_template.jinja and processor_config.json nesting the sub-processors'
    settings."""
    tiny.tokenizer.save_pretrained(directory)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    image = {**tiny.image_processor.to_dict(), "image_processor_type": "GotOcr2ImageProcessor"}
    video = {**VIDEO_SETTINGS, "video_processor_type": "InternVLVideoProcessor",
             "resample": 3, "do_sample_frames": False}
    (directory / "processor_config.json").write_text(json.dumps({
        "image_processor": image, "video_processor": video,
        "image_seq_length": TOKENS_PER_TILE, "processor_class": "InternVLProcessor",
    }, indent=2, default=str))


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the Hub's (transformers 4.5x's spellings)."""
    text = dict(config["text_config"])
    text["rope_theta"] = text.pop("rope_parameters")["rope_theta"]
    text["rope_scaling"] = None
    text.pop("dtype", None)
    text["torch_dtype"] = "bfloat16"
    if "num_local_experts" in text:  # Qwen3-MoE's name for it in transformers 4.5x
        text["num_experts"] = text.pop("num_local_experts")
    vision = {k: v for k, v in config["vision_config"].items() if k != "dtype"}
    hub = {k: v for k, v in config.items() if k not in ("dtype", "text_config", "vision_config")}
    return {**hub, "text_config": text, "vision_config": vision, "torch_dtype": "bfloat16",
            "transformers_version": "4.52.0.dev0"}


def _save_hub_weights(tiny: TinyModel, directory: Path) -> None:
    """The module tree's names, a tied head left out (as the Hub's 1B and 2B)."""
    tied = tiny.model.config.tie_word_embeddings
    weights = {name: value.detach().numpy().copy()
               for name, value in tiny.model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    write_safetensors(one_tensor_per_expert(weights), directory)


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    for name in ("processor_config.json", "preprocessor_config.json", "chat_template.json",
                 "chat_template.jinja", "tokenizer_config.json", "tokenizer.json",
                 "video_preprocessor_config.json"):
        (directory / name).unlink(missing_ok=True)
    preprocessor = {
        **IMAGE_SETTINGS, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
        "do_resize": True, "image_processor_type": "GotOcr2ImageProcessorFast",
        "processor_class": "InternVLProcessor", "resample": 3, "rescale_factor": 1 / 255,
        "default_to_square": True, "crop_size": None, "do_center_crop": None,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    video = {
        **VIDEO_SETTINGS, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
        "do_resize": True, "resample": 3, "rescale_factor": 1 / 255,
        "video_processor_type": "InternVLVideoProcessor", "processor_class": "InternVLProcessor",
        "do_sample_frames": False,
    }
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (directory / "processor_config.json").write_text(json.dumps(
        {"image_seq_length": TOKENS_PER_TILE, "processor_class": "InternVLProcessor"}, indent=2))
    tiny.tokenizer.save_pretrained(directory)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    tokenizer_config["extra_special_tokens"] = IMAGE_TOKENS
    tokenizer_config["processor_class"] = "InternVLProcessor"
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
