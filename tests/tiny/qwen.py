"""Tiny Hugging Face checkpoints built offline, for parity tests against transformers.

A checkpoint is a randomly initialised transformers model (float32), a byte-level BPE
tokenizer made with the ``tokenizers`` library (with the Qwen special tokens and a
Qwen-style chat template), and the PIL image processor with small pixel limits, saved
into a directory in one of two layouts:

``"transformers"``
    ``config.json`` exactly as transformers 5's ``save_pretrained`` writes it
    (``text_config`` with ``rope_parameters``, ``qwen2_vl_vision`` sub-config type) and
    tensors named by the module tree (``model.language_model.*``, ``model.visual.*``,
    ``lm_head.*``), as transformers 4.52-4.57 saved them. (transformers 5.24's
    ``save_pretrained`` itself writes the legacy tensor names of the other layout.)
``"hub"``
    The older layout of the checkpoints on the Hub: text parameters at the top level,
    ``rope_theta``, ``rope_scaling: {"type": "mrope", "mrope_section": [...]}``, a
    ``vision_config`` with the family's own ``model_type`` and ``in_chans``, tensors
    named ``model.layers.*``, ``model.embed_tokens.*``, ``visual.*``, ``lm_head.*``,
    ``preprocessor_config.json`` with ``min_pixels``/``max_pixels`` and the chat
    template in ``chat_template.json``.

Qwen3-VL's Hub checkpoints (released with transformers 4.57) differ from that older
layout: they keep ``text_config`` nested (with ``rope_scaling: {"mrope_interleaved": true,
"mrope_section": [...], "rope_type": "default"}`` and ``rope_theta`` inside it), name
tensors by the module tree, write the vision config's ``model_type`` as the family's, the
image processor's limits as ``size: {"shortest_edge", "longest_edge"}``, and (MoE) store
expert tensors as (experts, in, out) where transformers 5 writes (experts, out, in).

Tiny random models can lie: with transformers' default ``initializer_range`` (0.02) their
output ignores both image and prompt. So weights use a large range, biases and norm
weights are perturbed away from their constant init, and the text rope θ is not the
default, so that a loader reading the wrong config key fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny.common import (
    INIT_RANGE,
    TinyModel,
    build_bpe_tokenizer,
    perturb_constants,
    write_safetensors,
)

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
QWEN3_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
LAYOUTS = ("transformers", "hub")

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen-style: a default system turn, content either a string or a list of parts, one
# vision block per image/video part.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Text model: θ far from the default 1e6, so reading the wrong key changes the logits.
TEXT_ROPE_THETA = 5000.0
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112


# ------------------------------------------------------------------------------ tokenizer


def build_tokenizer():
    """A byte-level BPE tokenizer with the Qwen special tokens and chat template."""
    return build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


# Qwen3-VL: 16-pixel patches, so a 2x2 merge block covers 32 pixels.
QWEN3_MIN_PIXELS = 64 * 64
QWEN3_MAX_PIXELS = 128 * 128


# Qwen3-VL's video processor budgets the pixels of a whole video: room for a 3 s clip at
# 2 fps of 96x64 frames, not for a long one (which is shrunk to fit).
QWEN3_VIDEO_MAX_PIXELS = 8 * 96 * 64


def write_video_processor_config(family: str, directory: Path) -> None:
    """Qwen3-VL checkpoints ship video_preprocessor_config.json (Qwen3VLVideoProcessor);
    Qwen2-VL and Qwen2.5-VL ones share preprocessor_config.json with the image processor."""
    if family not in QWEN3_FAMILIES:
        return
    config = {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": PROCESSOR_CLASSES[family],
        "size": {"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_VIDEO_MAX_PIXELS},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": 768,
    }
    (directory / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2))


def build_image_processor(family: str = "qwen2_vl"):
    from transformers import Qwen2VLImageProcessorPil

    if family in QWEN3_FAMILIES:
        return Qwen2VLImageProcessorPil(
            patch_size=16, min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS,
            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        )
    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                     "qwen3_vl": "Qwen3VLProcessor", "qwen3_vl_moe": "Qwen3VLProcessor"}


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts, for images and text
    (its video processor needs torchvision)."""
    import transformers

    from mlxvlm.models.processor_utils import image_only

    processor_class = image_only(getattr(transformers, PROCESSOR_CLASSES[tiny.family]))
    return processor_class(image_processor=tiny.image_processor, tokenizer=tiny.tokenizer,
                           video_processor=None, chat_template=CHAT_TEMPLATE)


# ---------------------------------------------------------------------------------- model


def _special_ids(tokenizer) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }


def _text_config(tokenizer) -> dict:
    ids = _special_ids(tokenizer)
    return dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # head_dim 32: the smallest that an 8-bit KV cache (group size 32) can quantize
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        # 16 rotary frequencies split over (temporal, height, width) like [16, 24, 24]
        rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA,
                         "mrope_section": [4, 6, 6]},
        initializer_range=INIT_RANGE,
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    )


def _config(family: str, tokenizer):
    ids = _special_ids(tokenizer)
    token_ids = {k: ids[k] for k in
                 ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        # Tied embeddings, like Qwen2-VL-2B.
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                      initializer_range=INIT_RANGE)
        return Qwen2VLConfig(text_config=_text_config(tokenizer), vision_config=vision,
                             tie_word_embeddings=True, **token_ids)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        # Windows of 2x2 merged tokens (56 px), so small images span several windows;
        # block 0 attends within windows, block 1 over the whole image.
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                      num_heads=2, window_size=56, fullatt_block_indexes=[1],
                      tokens_per_second=2, initializer_range=INIT_RANGE)
        return Qwen2_5_VLConfig(text_config=_text_config(tokenizer), vision_config=vision,
                                tie_word_embeddings=False, **token_ids)
    if family in QWEN3_FAMILIES:
        return _qwen3_config(family, tokenizer, token_ids)
    raise ValueError(f"unknown family {family!r}")


def _qwen3_config(family: str, tokenizer, token_ids: dict):
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    # 4 heads of 32 (explicit head_dim, not hidden / heads); DeepStack taps after both
    # vision blocks feed both decoder layers; a 4x4 learned position table is resampled.
    text = dict(_text_config(tokenizer), num_attention_heads=4, num_key_value_heads=2,
                head_dim=32)
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                  num_heads=2, patch_size=16, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1], initializer_range=INIT_RANGE)
    if family == "qwen3_vl":
        # Tied embeddings, like Qwen3-VL-2B/4B.
        return Qwen3VLConfig(text_config=text, vision_config=vision,
                             tie_word_embeddings=True, **token_ids)
    # 4 experts of width 16, 2 per token; layer 1 keeps a dense MLP (mlp_only_layers).
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                mlp_only_layers=[1])
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision,
                            tie_word_embeddings=False, **token_ids)


# Seed offsets per family, picked so that every parity prompt gets 24 greedy tokens with
# clear top-1/top-2 margins (see TinyCheckpoints).
_SEED_OFFSET = {"qwen3_vl": 0, "qwen3_vl_moe": 2}


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    tokenizer = build_tokenizer()
    config = _config(family, tokenizer)
    model_class = {
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration,
        "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,
    }[family]
    seed += _SEED_OFFSET.get(family, 0)
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    ids = _special_ids(tokenizer)
    model.generation_config.bos_token_id = ids["bos_token_id"]
    model.generation_config.eos_token_id = ids["eos_token_id"]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    return TinyModel(family, model, tokenizer, build_image_processor(family))


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    """Write ``tiny`` into ``directory`` in ``layout`` ("transformers" or "hub")."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    weights = _module_tree_weights(tiny.model)
    if layout == "transformers":
        tiny.tokenizer.save_pretrained(directory)
        tiny.image_processor.save_pretrained(directory)
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    elif layout == "hub" and tiny.family in QWEN3_FAMILIES:
        weights = {name: _qwen3_hub_tensor(name, value) for name, value in weights.items()}
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(qwen3_hub_config(config), indent=2))
        _save_hub_processor_files(tiny, directory)
    elif layout == "hub":
        weights = {_legacy_name(name): value for name, value in weights.items()}
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
        _save_hub_processor_files(tiny, directory)
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    write_video_processor_config(tiny.family, directory)
    write_safetensors(weights, directory)
    return directory


def _module_tree_weights(model) -> dict[str, np.ndarray]:
    """The state dict under module names, without the head when it is tied."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {name: value.detach().cpu().numpy() for name, value in state.items()}


def _legacy_name(name: str) -> str:
    """Module name -> the name in the Hub's original Qwen2-VL/Qwen2.5-VL safetensors."""
    if name.startswith("model.visual."):
        return name[len("model.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


# Keys real Hub configs carry in vision_config (Qwen/Qwen2-VL-*-Instruct,
# Qwen/Qwen2.5-VL-*-Instruct), with their old spellings.
_HUB_VISION_KEYS = {
    "qwen2_vl": ("depth", "embed_dim", "mlp_ratio", "num_heads", "hidden_size", "patch_size",
                 "spatial_merge_size", "temporal_patch_size"),
    "qwen2_5_vl": ("depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads",
                   "out_hidden_size", "patch_size", "spatial_merge_size", "window_size",
                   "fullatt_block_indexes", "tokens_per_second", "temporal_patch_size"),
}
_V5_ONLY_TEXT_KEYS = ("model_type", "rope_parameters", "layer_types", "dtype", "pad_token_id")


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the layout of the Hub's original checkpoints."""
    family = config["model_type"]
    text = config["text_config"]
    rope = text["rope_parameters"]
    hub = {k: v for k, v in config.items()
           if k not in ("text_config", "vision_config", "dtype", "transformers_version")}
    hub.update({k: v for k, v in text.items() if k not in _V5_ONLY_TEXT_KEYS})
    hub["rope_theta"] = rope["rope_theta"]
    hub["rope_scaling"] = {"type": "mrope", "mrope_section": list(rope["mrope_section"])}
    hub["sliding_window"] = 32768
    hub["torch_dtype"] = "float32"
    hub["transformers_version"] = "4.41.2"
    vision = config["vision_config"]
    hub_vision = {k: vision[k] for k in _HUB_VISION_KEYS[family] if k in vision}
    hub_vision["in_chans"] = vision.get("in_channels", 3)
    hub_vision["spatial_patch_size"] = vision["patch_size"]
    hub_vision["model_type"] = family
    hub["vision_config"] = hub_vision
    return hub


def _qwen3_hub_tensor(name: str, value: np.ndarray) -> np.ndarray:
    """The Hub's Qwen3-VL-MoE checkpoints store experts as (experts, in, out)."""
    if ".mlp.experts." in name:
        return np.ascontiguousarray(value.transpose(0, 2, 1))
    return value


def qwen3_hub_config(config: dict) -> dict:
    """transformers 5's Qwen3-VL config.json -> the layout of Qwen/Qwen3-VL-*'s (4.57)."""
    family = config["model_type"]
    hub = {k: v for k, v in config.items() if k not in ("dtype", "transformers_version")}
    text = {k: v for k, v in config["text_config"].items()
            if k not in ("rope_parameters", "dtype", "num_local_experts")}
    rope = config["text_config"]["rope_parameters"]
    text["rope_scaling"] = {"mrope_interleaved": True,
                            "mrope_section": list(rope["mrope_section"]), "rope_type": "default"}
    text["rope_theta"] = rope["rope_theta"]
    text["tie_word_embeddings"] = config["tie_word_embeddings"]
    if "num_local_experts" in config["text_config"]:
        text["num_experts"] = config["text_config"]["num_local_experts"]
        text["norm_topk_prob"] = True
    hub["text_config"] = text
    vision = {k: v for k, v in config["vision_config"].items() if k != "rope_parameters"}
    vision["model_type"] = family
    hub["vision_config"] = vision
    hub["torch_dtype"] = "float32"
    hub["transformers_version"] = "4.57.0.dev0"
    return hub


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    processor_class = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                       "qwen3_vl": "Qwen3VLProcessor", "qwen3_vl_moe": "Qwen3VLProcessor"}
    image_processor = tiny.image_processor
    if tiny.family in QWEN3_FAMILIES:
        limits = {"size": {"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS}}
    else:
        limits = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    preprocessor = {
        **limits,
        "patch_size": image_processor.patch_size,
        "temporal_patch_size": image_processor.temporal_patch_size,
        "merge_size": image_processor.merge_size,
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class[tiny.family],
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    tiny.tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
