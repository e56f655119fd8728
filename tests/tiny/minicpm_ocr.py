"""A tiny MiniCPM-OCR checkpoint (see tests/tiny/__init__.py): MiniCPM-V 4.6's tiny
model (tests/tiny/minicpmv4_6.py: the same tower, merger, hybrid text model, tokenizer
and chat template) built as transformers' ``MiniCPMOcrForConditionalGeneration`` with
MiniCPM-OCR's defaults: ``downsample_mode`` ``"4x"`` (no window merger: a view of 8 x 8
patches gives 16 tokens) and tied embeddings. The image processor is transformers' own
(``MiniCPMOcrImageProcessor``, torchvision), saved as transformers saves it; in the
Hub's layout the files are laid out as MiniCPM-V 4.6's Hub files are, and
``generation_config.json`` samples (``HUB_SAMPLING``).
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import TinyModel, perturb_constants
from tiny.minicpmv4_6 import (
    CHAT_TEMPLATE,
    LAYOUTS,
    build_tokenizer,
    save_minicpm_checkpoint,
    text_and_vision_configs,
    token_ids,
)

FAMILIES = ("minicpm_ocr",)
__all__ = ["FAMILIES", "LAYOUTS", "build_tiny_model", "save_checkpoint", "reference_processor"]

PATCH = 4
SLICE = 32
# The hub layout's generation_config.json sampling values (the loader's defaults).
HUB_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 100}
IMAGE_SETTINGS = dict(max_slice_nums=4, scale_resolution=SLICE, patch_size=PATCH,
                      slice_mode=True, use_image_id=True)  # "4x", "always": the defaults


def build_image_processor(**settings):
    """transformers' (torchvision) image processor with the tiny settings."""
    from transformers import MiniCPMOcrImageProcessor

    return MiniCPMOcrImageProcessor(**{**IMAGE_SETTINGS, **settings})


def reference_processor(tiny: TinyModel):
    """transformers' own ``MiniCPMOcrProcessor`` (torchvision image and video processors)."""
    from transformers import MiniCPMOcrProcessor, MiniCPMOcrVideoProcessor

    return MiniCPMOcrProcessor(image_processor=tiny.image_processor, tokenizer=tiny.tokenizer,
                               video_processor=MiniCPMOcrVideoProcessor(**IMAGE_SETTINGS),
                               chat_template=CHAT_TEMPLATE)


def _config(tokenizer):
    from transformers import MiniCPMOcrConfig

    ids = token_ids(tokenizer)
    text, vision = text_and_vision_configs(tokenizer)
    # downsample_mode and tie_word_embeddings left to MiniCPMOcrConfig's defaults
    return MiniCPMOcrConfig(text_config=text, vision_config=vision, insert_layer_id=1,
                            image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], merge_kernel_size=[2, 2],
                            merger_times=1)


# Picked so that every parity prompt gets its greedy tokens with clear top-1/top-2 margins.
SEED_OFFSET = 3


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import MiniCPMOcrForConditionalGeneration

    tokenizer = build_tokenizer()
    seed += SEED_OFFSET
    torch.manual_seed(seed)
    model = MiniCPMOcrForConditionalGeneration(_config(tokenizer)).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return TinyModel(family, model, tokenizer, build_image_processor())


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    from transformers import MiniCPMOcrVideoProcessor

    directory = save_minicpm_checkpoint(
        tiny, directory, layout, image_processor_type="MiniCPMOcrImageProcessor",
        processor_class="MiniCPMOcrProcessor",
        video_processor=MiniCPMOcrVideoProcessor(**IMAGE_SETTINGS))
    if layout == "hub":
        generation = json.loads((directory / "generation_config.json").read_text())
        generation.update(do_sample=True, **HUB_SAMPLING)
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory
