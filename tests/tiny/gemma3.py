"""Tiny Gemma 3 checkpoints (see tests/tiny/__init__.py), in two layouts:

``"transformers"``
    Exactly what transformers 5's ``save_pretrained`` writes for the model and the processor:
    ``text_config`` with ``layer_types`` and per-layer-type ``rope_parameters``, tensors
    named ``language_model.model.*`` and ``vision_tower.*`` (no ``vision_model.`` level),
    ``processor_config.json`` holding the image processor's settings.
``"hub"``
    google/gemma-3-4b-it's layout: a ``text_config`` naming only what differs from
    transformers' defaults (``rope_scaling``, ``rope_theta``/``rope_local_base_freq``,
    no ``layer_types``: the default sliding-window pattern of 6 applies), tensors named
    ``language_model.model.*``, ``vision_tower.vision_model.*`` and
    ``multi_modal_projector.*`` with the tied head left out, ``preprocessor_config.json`` and
    ``processor_config.json`` (``image_seq_length``), the chat template in
    ``chat_template.json``.

The sliding window (16) is shorter than every test prompt, global and local rope θ are
both off their defaults and global layers use linear rope scaling, so a loader reading the
wrong key or mishandling the window fails parity. The projector's weight, which
transformers initialises to zero, is drawn at random.
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

FAMILIES = ("gemma3",)
LAYOUTS = ("transformers", "hub")

SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>",
)

# Gemma 3's chat template, less the system-prompt folding the tests do not use.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

IMAGE_SIZE = 64  # 8 x 8 patches of 8 pixels, pooled to 4 x 4 = 16 tokens per image
MM_TOKENS_PER_IMAGE = 16
SLIDING_WINDOW = 16
GLOBAL_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 20_000.0}
LOCAL_ROPE_THETA = 500.0


def build_tokenizer():
    from transformers import PreTrainedTokenizerFast

    bpe = build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<eos>", pad_token="<pad>",
        bos_token="<bos>",
    )
    # Gemma3Processor reads the image tokens from these tokenizer attributes.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe.backend_tokenizer, bos_token="<bos>", eos_token="<eos>",
        pad_token="<pad>", errors="replace",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(tokenizer, image_processor=None):
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    image_processor = image_processor or Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                           image_seq_length=MM_TOKENS_PER_IMAGE, chat_template=CHAT_TEMPLATE)


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts."""
    return build_processor(tiny.tokenizer, tiny.image_processor)


def _token_ids(tokenizer) -> dict:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return dict(
        pad=ids["<pad>"], eos=ids["<eos>"], bos=ids["<bos>"], end_of_turn=ids["<end_of_turn>"],
        boi=ids["<start_of_image>"], eoi=ids["<end_of_image>"], image=ids["<image_soft_token>"],
    )


def _config(tokenizer):
    from transformers import Gemma3Config

    ids = _token_ids(tokenizer)
    text = dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16,
        # sqrt(48) is not a bfloat16 value: an embedding scale rounded to bfloat16 shows.
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # the smallest an 8-bit KV cache (group size 32) can quantize
        query_pre_attn_scalar=24,  # not head_dim: the attention scale must come from here
        sliding_window=SLIDING_WINDOW,
        max_position_embeddings=1024,
        rope_parameters={"full_attention": dict(GLOBAL_ROPE),
                         "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_THETA}},
        initializer_range=INIT_RANGE,
        pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["end_of_turn"]],
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=8, vision_use_head=False,
                  initializer_range=INIT_RANGE)
    return Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        boi_token_index=ids["boi"], eoi_token_index=ids["eoi"], image_token_index=ids["image"],
        initializer_range=INIT_RANGE,
    )


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Gemma3ForConditionalGeneration

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(_config(tokenizer)).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    perturb_constants(model, generator)
    with torch.no_grad():
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.copy_(INIT_RANGE * torch.randn(projection.shape, generator=generator))
    ids = _token_ids(tokenizer)
    model.generation_config.bos_token_id = ids["bos"]
    model.generation_config.eos_token_id = [ids["eos"], ids["end_of_turn"]]
    model.generation_config.pad_token_id = ids["pad"]
    return TinyModel(family, model, tokenizer, build_processor(tokenizer).image_processor)


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    if layout == "transformers":
        build_processor(tiny.tokenizer, tiny.image_processor).save_pretrained(directory)
        return directory
    if layout != "hub":
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
    write_safetensors(hub_weights(tiny.model), directory)
    _save_hub_processor_files(tiny, directory)
    return directory


def hub_weights(model) -> dict[str, np.ndarray]:
    """The tensors under the names of google/gemma-3-*-it's safetensors (tied head left out)."""
    weights = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        for new, old in (("model.language_model.", "language_model.model."),
                         ("model.vision_tower.", "vision_tower.vision_model."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")):
            if name.startswith(new):
                name = old + name[len(new):]
        weights[name] = value.detach().cpu().numpy()
    return weights


# Text keys google/gemma-3-4b-it's config.json names, plus those the tiny model sets off
# transformers' defaults, in their old spellings.
_HUB_TEXT_KEYS = ("hidden_size", "intermediate_size", "model_type", "num_hidden_layers",
                  "sliding_window", "vocab_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "query_pre_attn_scalar", "max_position_embeddings",
                  "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")
_HUB_VISION_KEYS = ("hidden_size", "image_size", "intermediate_size", "model_type",
                    "num_attention_heads", "num_hidden_layers", "patch_size", "vision_use_head")


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the layout of google/gemma-3-*-it's."""
    text, vision = config["text_config"], config["vision_config"]
    rope = text["rope_parameters"]
    hub_text = {k: text[k] for k in _HUB_TEXT_KEYS}
    hub_text["rope_scaling"] = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
    hub_text["rope_theta"] = rope["full_attention"]["rope_theta"]
    hub_text["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": config["boi_token_index"],
        "eoi_token_index": config["eoi_token_index"],
        "eos_token_id": text["eos_token_id"],
        "image_token_index": config["image_token_index"],
        "initializer_range": config["initializer_range"],
        "mm_tokens_per_image": config["mm_tokens_per_image"],
        "model_type": "gemma3",
        "text_config": hub_text,
        "torch_dtype": "float32",
        "transformers_version": "4.50.0.dev0",
        "vision_config": {k: vision[k] for k in _HUB_VISION_KEYS},
    }


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    for name in ("processor_config.json", "chat_template.jinja", "preprocessor_config.json"):
        (directory / name).unlink(missing_ok=True)
    image_processor = tiny.image_processor
    preprocessor = {
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None,
        "do_rescale": True, "do_resize": True,
        "image_mean": list(image_processor.image_mean), "image_std": list(image_processor.image_std),
        "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": MM_TOKENS_PER_IMAGE,
        "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 1 / 255,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (directory / "processor_config.json").write_text(json.dumps(
        {"image_seq_length": MM_TOKENS_PER_IMAGE, "processor_class": "Gemma3Processor"}, indent=2))
    tiny.tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
