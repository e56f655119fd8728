"""Tiny Mistral 3 and Pixtral (LLaVA + Pixtral tower) checkpoints for parity tests.

A checkpoint is a randomly initialised transformers model (float32) with a Pixtral vision
tower and a Mistral text model, a byte-level BPE tokenizer with Mistral's special tokens
and a Mistral-style chat template, and transformers' PIL Pixtral image processor, saved
in one of two layouts:

``"transformers"``
    config.json as transformers 5's ``save_pretrained`` writes it (``rope_parameters``,
    an explicit ``tie_word_embeddings``), tensors named by the module tree
    (``model.vision_tower.*``, ``model.multi_modal_projector.*``,
    ``model.language_model.*``, ``lm_head.*``), and the processor settings nested in one
    processor_config.json.
``"hub"``
    The layout of mistralai/Mistral-Small-3.1-24B-Instruct-2503 and
    mistral-community/pixtral-12b: ``rope_theta`` in both sub-configs, no
    ``tie_word_embeddings`` key, tensors named ``vision_tower.*``,
    ``multi_modal_projector.*``, ``language_model.model.*``, ``language_model.lm_head.*``,
    preprocessor_config.json beside a flat processor_config.json, and the chat template
    in chat_template.json.

The ``pixtral`` family's config says ``model_type: "pixtral"``, as mlx-community's
conversions do (the Hub's original says ``llava``; ``llava_config`` gives that one).
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import (
    INIT_RANGE,
    TinyModel,
    build_bpe_tokenizer,
    perturb_constants,
    write_safetensors,
)

FAMILIES = ("mistral3", "pixtral")
LAYOUTS = ("transformers", "hub")

SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[IMG]", "[IMG_BREAK]", "[IMG_END]",
)

# Mistral Small 3.1's template, reduced: system prompt block, [INST] turns with [IMG]
# where images go, assistant turns closed by </s>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for part in parts %}{{ part['text'] }}{% endfor %}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]"
    "{% for part in parts %}{% if part['type'] == 'image' %}[IMG]"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}[/INST]"
    "{% else %}{% for part in parts %}{{ part['text'] }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)

# Per family: vision patch size and the merge of patches into tokens (Mistral 3: 2x2).
PATCH_SIZE = {"mistral3": 14, "pixtral": 16}
MERGE = {"mistral3": 2, "pixtral": 1}
LONGEST_EDGE = 112
TEXT_ROPE_THETA = 5000.0  # far from Mistral's 1e9 / 1e6 defaults
VISION_ROPE_THETA = 500.0  # far from Pixtral's 10000


def build_tokenizer():
    return build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="</s>", pad_token="<unk>",
        bos_token="<s>",
    )


def build_image_processor(family: str):
    from transformers import PixtralImageProcessorPil

    patch = PATCH_SIZE[family]
    return PixtralImageProcessorPil(
        patch_size={"height": patch, "width": patch}, size={"longest_edge": LONGEST_EDGE}
    )


def build_processor(tiny: TinyModel):
    from mlxvlm.models.pixtral import PixtralProcessor

    return PixtralProcessor(
        image_processor=tiny.image_processor, tokenizer=tiny.tokenizer,
        patch_size=PATCH_SIZE[tiny.family], spatial_merge_size=MERGE[tiny.family],
        chat_template=CHAT_TEMPLATE,
    )


def _config(family: str, tokenizer):
    from transformers import LlavaConfig, Mistral3Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    # 4 heads of 32 on a 64-wide model: head_dim is not hidden / heads (as Mistral Small).
    text = dict(
        model_type="mistral", vocab_size=(len(tokenizer) + 15) // 16 * 16, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=TEXT_ROPE_THETA, sliding_window=None, initializer_range=INIT_RANGE,
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<unk>"],
    )
    vision = dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, patch_size=PATCH_SIZE[family], image_size=LONGEST_EDGE,
        hidden_act="silu", rope_theta=VISION_ROPE_THETA, initializer_range=INIT_RANGE,
    )
    if family == "mistral3":
        return Mistral3Config(text_config=text, vision_config=vision,
                              image_token_index=ids["[IMG]"], spatial_merge_size=2,
                              tie_word_embeddings=False)
    return LlavaConfig(text_config=text, vision_config=vision, image_token_index=ids["[IMG]"],
                       vision_feature_select_strategy="full", vision_feature_layer=-1,
                       tie_word_embeddings=False)


_SEED_OFFSET = {"mistral3": 3, "pixtral": 0}


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import LlavaForConditionalGeneration, Mistral3ForConditionalGeneration

    tokenizer = build_tokenizer()
    config = _config(family, tokenizer)
    model_class = {"mistral3": Mistral3ForConditionalGeneration,
                   "pixtral": LlavaForConditionalGeneration}[family]
    torch.manual_seed(seed + _SEED_OFFSET[family])
    model = model_class(config).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, config.text_config.to_dict()[key])
    return TinyModel(family, model, tokenizer, build_image_processor(family))


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    state = tiny.model.state_dict()
    weights = {name: value.detach().cpu().numpy() for name, value in state.items()}
    config = json.loads((directory / "config.json").read_text())
    if layout == "transformers":
        build_processor(tiny).save_pretrained(directory)
    elif layout == "hub":
        weights = {_legacy_name(name): value for name, value in weights.items()}
        config = hub_config(config)
        _save_hub_processor_files(tiny, directory)
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    if tiny.family == "pixtral":
        config["model_type"] = "pixtral"
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(weights, directory)
    return directory


def llava_config(directory: Path) -> dict:
    """A pixtral checkpoint's config.json as the Hub's original has it (``llava``)."""
    return {**json.loads((Path(directory) / "config.json").read_text()), "model_type": "llava"}


def _legacy_name(name: str) -> str:
    """Module name -> the name in the Hub's Mistral 3 / Pixtral safetensors."""
    for prefix, legacy in (("model.language_model.", "language_model.model."),
                           ("model.vision_tower.", "vision_tower."),
                           ("model.multi_modal_projector.", "multi_modal_projector."),
                           ("lm_head.", "language_model.lm_head.")):
        if name.startswith(prefix):
            return legacy + name[len(prefix):]
    return name


_V5_ONLY = ("rope_parameters", "dtype", "transformers_version", "tie_word_embeddings")


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the Hub's older layout (see module docstring)."""
    hub = {k: v for k, v in config.items() if k not in _V5_ONLY + ("text_config", "vision_config")}
    text = {k: v for k, v in config["text_config"].items() if k not in _V5_ONLY}
    text["rope_theta"] = config["text_config"]["rope_parameters"]["rope_theta"]
    vision = {k: v for k, v in config["vision_config"].items() if k not in _V5_ONLY}
    vision["rope_theta"] = config["vision_config"]["rope_parameters"]["rope_theta"]
    hub.update(text_config=text, vision_config=vision, torch_dtype="float32",
               transformers_version="4.50.0.dev0")
    return hub


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    ip = tiny.image_processor
    preprocessor = {
        "image_processor_type": "PixtralImageProcessorFast",
        "processor_class": "PixtralProcessor",
        "patch_size": PATCH_SIZE[tiny.family],
        "size": {"longest_edge": LONGEST_EDGE},
        "image_mean": list(ip.image_mean), "image_std": list(ip.image_std),
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "resample": 3, "rescale_factor": 1 / 255,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    processor = {
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
        "image_token": "[IMG]", "patch_size": PATCH_SIZE[tiny.family],
        "processor_class": "PixtralProcessor",
    }
    if MERGE[tiny.family] != 1:
        processor["spatial_merge_size"] = MERGE[tiny.family]
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))
    tiny.tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))


def transformers_processor(tiny: TinyModel):
    """transformers' own PixtralProcessor, whose module imports torchvision only for a
    helper that the PIL image processor module also has: imported with that module
    standing in, for tests only."""
    import importlib
    import sys

    from transformers.models.pixtral import image_processing_pil_pixtral

    key = "transformers.models.pixtral.image_processing_pixtral"
    sys.modules[key] = image_processing_pil_pixtral
    try:
        module = importlib.import_module("transformers.models.pixtral.processing_pixtral")
    finally:
        del sys.modules[key]
    return module.PixtralProcessor(
        image_processor=tiny.image_processor, tokenizer=tiny.tokenizer,
        patch_size=PATCH_SIZE[tiny.family], spatial_merge_size=MERGE[tiny.family],
        chat_template=CHAT_TEMPLATE,
    )


reference_processor = transformers_processor
