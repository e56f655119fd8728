"""Registry: a checkpoint's ``model_type`` -> the family module that implements it.

Each family module exposes ``Model``, a ``VisionLanguageModel`` (``models/base.py``):
the loader reaches a family only through that class (``from_config``,
``is_hf_checkpoint``, ``sanitize``, ``load_processor``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from mlxvlm.errors import MlxvlmError

# model_type (as written in config.json) -> module name under mlxvlm.models
FAMILIES: dict[str, str] = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "gemma3": "gemma3",
    "gemma3n": "gemma3n",
    "idefics3": "idefics3",
    # SmolVLM is Idefics3 under another name (see models/idefics3.py)
    "smolvlm": "idefics3",
    "llava": "llava",
    "llava_next": "llava_next",
    "llava_onevision": "llava_onevision",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl_moe",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "mistral3": "mistral3",
    "pixtral": "pixtral",
    "paligemma": "paligemma",
    # the Hub's full model and transformers' thinker alone; text output only
    "qwen2_5_omni": "qwen2_5_omni",
    "qwen2_5_omni_thinker": "qwen2_5_omni",
    "paddleocr_vl": "paddleocr_vl",
    "lfm2_vl": "lfm2_vl",
    "lfm2-vl": "lfm2_vl",  # LiquidAI's first configs
    "qwen3_omni_moe": "qwen3_omni_moe",
    "qwen3_omni_moe_thinker": "qwen3_omni_moe",
    "gemma4": "gemma4",
    # retrieval models (mlxvlm.retrieval): one vector per token
    "colqwen2": "colqwen2",
    "colpali": "colpali",
    # GLM-4.6V-Flash / GLM-4.1V (dense) and GLM-4.6V / GLM-4.5V (MoE); glm46v: what
    # transformers' Glm46VForConditionalGeneration saves
    "glm4v": "glm4v",
    "glm4v_moe": "glm4v",
    "glm46v": "glm4v",
    "mllama": "mllama",
    # transformers' native layout (the Hub's *-HF checkpoints)
    "internvl": "internvl",
    "minicpmv4_6": "minicpmv4_6",
    # MiniCPM-OCR: MiniCPM-V 4.6's model with its own defaults (models/minicpm_ocr.py)
    "minicpm_ocr": "minicpm_ocr",
    # GLM-OCR: GLM-4.6V-Flash's layers with its own switches (models/glm_ocr.py)
    "glm_ocr": "glm_ocr",
    # DeepSeek-OCR 2: SAM + a Qwen2 query encoder, DeepSeek-MoE text (models/deepseek_ocr2.py)
    "deepseek_ocr2": "deepseek_ocr2",
    "deepseekocr_2": "deepseek_ocr2",  # mlx-community's conversions (DeepSeek's own config)
    # Granite-Docling: Idefics3-style tiles, DeepStack taps, Granite's decoder
    "granite_docling": "granite_docling",
    # transformers' native layout (the Hub's original is phi4mm, with remote code)
    "phi4_multimodal": "phi4_multimodal",
}


# model_types mlxvlm recognizes but does not load -> what to use instead.
REFUSED: dict[str, str] = {
    # InternVL's original layout: remote code builds its prompts (the conversation
    # template its config names, the <image> placeholder expanded to tiles in code) and
    # its config names no image token, so no transformers processor is known to
    # reproduce them; every size has a transformers-native -HF conversion.
    "internvl_chat": (
        "InternVL's original layout (remote code) is not supported; use the model's -HF "
        "checkpoint instead (OpenGVLab/InternVL3_5-8B-HF for OpenGVLab/InternVL3_5-8B)"
    ),
    # Phi-4-multimodal's remote-code layout (the Hub's main branch, and mlx-community's
    # conversions of it): its LoRA adapters merged under other names and its processor in
    # remote code; mlxvlm reads transformers' native phi4_multimodal layout.
    "phi4mm": (
        "Phi-4-multimodal's remote-code layout is not supported; use a checkpoint in "
        "transformers' native layout (model_type phi4_multimodal: load the model with "
        "transformers' Phi4MultimodalForCausalLM and save_pretrained it)"
    ),
}


class UnsupportedModelError(MlxvlmError, ValueError):
    """The checkpoint's model_type has no family module."""


def get_family(model_type: str | None) -> ModuleType:
    if model_type in REFUSED:
        raise UnsupportedModelError(f"model_type {model_type!r}: {REFUSED[model_type]}")
    if model_type not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by mlxvlm (supported: {supported})"
        )
    return importlib.import_module(f"mlxvlm.models.{FAMILIES[model_type]}")
