"""Tiny ColQwen2 and ColPali checkpoints built offline (see tests/tiny/__init__.py):
transformers' ``ColQwen2ForRetrieval`` over the tiny Qwen2-VL of ``tiny/qwen.py`` and
``ColPaliForRetrieval`` over a tiny PaliGemma with Gemma 1 (``tiny/paligemma.py``'s
tokenizer and image processor), randomly initialised in float32.

Layouts: ``"transformers"`` (config.json and tensor names as transformers 5's
``save_pretrained`` writes them) and ``"hub"`` (as ``vidore/colqwen2-v1.0-hf`` and
``vidore/colpali-v1.3-hf``: ColQwen2's ``vlm_config`` in Qwen2-VL's older flat layout,
tensors under ``vlm.model.*``, resp. the older PaliGemma names under ``vlm.``; the image
processor's preprocessor_config.json beside a processor_config.json of prompts).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny import paligemma, qwen
from tiny.common import INIT_RANGE, TinyModel, perturb_constants, write_safetensors

FAMILIES = ("colqwen2", "colpali")
LAYOUTS = ("transformers", "hub")
EMBEDDING_DIM = 16


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    if family == "colpali":
        return build_tiny_colpali(seed)
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
    """transformers' ColQwen2Processor (ColPaliProcessor) over the tiny model's parts."""
    if tiny.family == "colpali":
        return reference_colpali_processor(tiny)
    from transformers import ColQwen2Processor

    return ColQwen2Processor(image_processor=tiny.image_processor, tokenizer=tiny.tokenizer)


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    reference_processor(tiny).save_pretrained(directory)
    weights = {name: value.detach().cpu().numpy()
               for name, value in tiny.model.state_dict().items()}
    if layout == "hub" and tiny.family == "colpali":
        weights = {_hub_colpali_name(name): value for name, value in weights.items()}
        _split_processor_config(directory)
    elif layout == "hub":
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
    image = dict(processor.pop("image_processor"), processor_class=processor["processor_class"])
    if "shortest_edge" in image.get("size", {}):  # Qwen2-VL's older pixel limits
        size = image.pop("size")
        image.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    (directory / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))


def reference_vectors(tiny: TinyModel, processor=None):
    """A function: a query (a string) or a page (a PIL image) -> transformers' vectors of
    its tokens, float32 ``[tokens, dim]`` (the padding left out by the attention mask)."""
    import torch

    processor = processor or reference_processor(tiny)

    def vectors(item) -> np.ndarray:
        inputs = (processor(text=[item]) if isinstance(item, str)
                  else processor(images=[item.convert("RGB")]))
        with torch.no_grad():
            out = tiny.model(**inputs).embeddings[0]
        return out[: int(inputs["attention_mask"][0].sum())].numpy()

    return vectors


def reference_maxsim(processor, query: np.ndarray, page: np.ndarray) -> float:
    """transformers' score_retrieval of one query against one page (one pair at a time:
    it pads a batch of pages with zero vectors)."""
    import torch

    return float(processor.score_retrieval([torch.from_numpy(query)],
                                           [torch.from_numpy(page)])[0, 0])


# ------------------------------------------------------------------------------ ColPali


def build_tiny_colpali(seed: int = 0) -> TinyModel:
    """transformers' ColPaliForRetrieval over a tiny PaliGemma with Gemma 1 (as
    ``vidore/colpali-v1.3-hf``'s PaliGemma-3B), the tokenizer and SigLIP image processor
    of ``tiny/paligemma.py``."""
    import torch
    from transformers import ColPaliConfig, ColPaliForRetrieval, PaliGemmaConfig

    tokenizer = paligemma.build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in paligemma.SPECIAL_TOKENS}
    text = dict(
        model_type="gemma", vocab_size=(len(tokenizer) + 15) // 16 * 16, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": paligemma.TEXT_ROPE_THETA},
        hidden_activation="gelu_pytorch_tanh", initializer_range=INIT_RANGE,
        bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
    )
    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, image_size=paligemma.IMAGE_SIZE,
        patch_size=paligemma.PATCH_SIZE, vision_use_head=False,
    )
    vlm = PaliGemmaConfig(text_config=text, vision_config=vision, projection_dim=64,
                          image_token_index=ids["<image>"])
    config = ColPaliConfig(vlm_config=vlm.to_dict(), embedding_dim=EMBEDDING_DIM)
    torch.manual_seed(seed)
    model = ColPaliForRetrieval(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():  # SigLIP's own init is tiny
            if "vision_tower" in name and name.endswith("weight") and param.ndim > 1:
                param.normal_(0.0, INIT_RANGE, generator=generator)
        model.vlm.language_model.embed_tokens.weight.normal_(
            0.0, paligemma.EMBED_RANGE, generator=generator)
    perturb_constants(model, generator)
    return TinyModel("colpali", model, tokenizer, paligemma.build_image_processor())


def reference_colpali_processor(tiny: TinyModel):
    from transformers import ColPaliProcessor

    return ColPaliProcessor(image_processor=tiny.image_processor, tokenizer=tiny.tokenizer)


def _hub_colpali_name(name: str) -> str:
    """transformers 5's module name -> the older PaliGemma names under ``vlm.``."""
    for prefix, legacy in (("vlm.language_model.", "vlm.language_model.model."),
                           ("vlm.vision_tower.", "vlm.vision_tower.vision_model."),
                           ("vlm.multi_modal_projector.", "vlm.multi_modal_projector.")):
        if name.startswith(prefix) and not name.startswith(legacy):
            return legacy + name[len(prefix):]
    return name
