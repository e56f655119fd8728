"""Tiny ColQwen2 checkpoints built offline (see tests/tiny/__init__.py): transformers'
``ColQwen2ForRetrieval`` over the tiny Qwen2-VL of ``tiny/qwen.py`` (its tokenizer,
image processor and sizes), randomly initialised in float32.

Layouts: ``"transformers"`` (config.json and tensor names as transformers 5's
``save_pretrained`` writes them) and ``"hub"`` (as ``vidore/colqwen2-v1.0-hf``: the
``vlm_config`` in Qwen2-VL's older flat layout, tensors under ``vlm.model.*``, the
processor's files with ``processor_class: ColQwen2Processor``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny import qwen
from tiny.common import TinyModel, perturb_constants, write_safetensors

FAMILIES = ("colqwen2",)
LAYOUTS = ("transformers", "hub")
EMBEDDING_DIM = 16


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import ColQwen2Config, ColQwen2ForRetrieval

    tokenizer = qwen.build_tokenizer()
    vlm_config = qwen._config("qwen2_vl", tokenizer)
    config = ColQwen2Config(vlm_config=vlm_config.to_dict(), embedding_dim=EMBEDDING_DIM)
    torch.manual_seed(seed)
    model = ColQwen2ForRetrieval(config).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    return TinyModel(family, model, tokenizer, qwen.build_image_processor("qwen2_vl"))


def reference_processor(tiny: TinyModel):
    """transformers' ColQwen2Processor over the tiny model's parts."""
    from transformers import ColQwen2Processor

    return ColQwen2Processor(image_processor=tiny.image_processor, tokenizer=tiny.tokenizer)


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    reference_processor(tiny).save_pretrained(directory)
    weights = {name: value.detach().cpu().numpy()
               for name, value in tiny.model.state_dict().items()}
    if layout == "hub":
        weights = {_hub_name(name): value for name, value in weights.items()}
        config = json.loads((directory / "config.json").read_text())
        vlm = dict(config["vlm_config"], architectures=["Qwen2VLForConditionalGeneration"])
        config["vlm_config"] = qwen.hub_config(vlm)
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        _split_processor_config(directory)
    elif layout != "transformers":
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    write_safetensors(weights, directory)
    return directory


def _hub_name(name: str) -> str:
    """transformers 5's module name -> the vidore checkpoints' (``vlm.model.*``)."""
    if name.startswith("vlm."):
        return "vlm.model." + name[len("vlm."):]
    return name


def _split_processor_config(directory: Path) -> None:
    """The older files: the image processor's preprocessor_config.json beside a
    processor_config.json that holds only the processor's own prompts."""
    processor = json.loads((directory / "processor_config.json").read_text())
    image = dict(processor.pop("image_processor"), processor_class="ColQwen2Processor")
    size = image.pop("size")
    image.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    (directory / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))
