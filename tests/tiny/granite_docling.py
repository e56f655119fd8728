"""A tiny Granite-Docling checkpoint (``granite_docling``; see tests/tiny/__init__.py), in
two layouts:

``"transformers"``
    Exactly what transformers 5's ``save_pretrained`` writes for the model and processor.
``"hub"``
    ibm-granite/granite-for-docling-500m's layout: the same config, the processor's files
    apart (``preprocessor_config.json``, ``processor_config.json`` with ``image_seq_len``,
    ``chat_template.jinja``), sampling defaults in ``generation_config.json`` and the extra
    prediction head serving engines read (``mtp.*``), which transformers ignores.

Tiles are 32 pixels (8 x 8 patches of 4): 4 tokens each on the coarse path (4 x 4 pixel
shuffle), 16 on the fine one (2 x 2). At most 4 tiles per page, so a landscape picture is
2 x 2 tiles plus the thumbnail and a wide one 1 x 3 plus the thumbnail. The vision tower
taps its layers 0 and 2 for DeepStack, added after the decoder's first two layers. The
tokenizer carries DocTags' tags (``<doctag>``, ``<otsl>`` ...) as added tokens, as
granite-docling's does, and adds no BOS (Granite's tokenizer adds none).
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors

FAMILIES = ("granite_docling",)
LAYOUTS = ("transformers", "hub")

ROW_COL_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5))
# DocTags' tags a page answer uses (granite-docling's tokenizer has all of them).
DOCTAGS = tuple(f"<{name}>" for name in (
    "doctag", "/doctag", "title", "/title", "text", "/text", "page_header", "/page_header",
    "section_header_level_1", "/section_header_level_1", "list_item", "/list_item",
    "unordered_list", "/unordered_list", "otsl", "/otsl", "fcel", "ecel", "ched", "rhed",
    "srow", "lcel", "nl", "picture", "/picture", "caption", "/caption",
)) + tuple(f"<loc_{i}>" for i in range(500))
SPECIAL_TOKENS = (
    "<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|pad|>",
    "<|endoftext|>",  # unused here: the BOS of tests/tiny/bos.py's variants
    "<fake_token_around_image>", "<image>", "<global-img>",
) + ROW_COL_TOKENS + DOCTAGS

# granite-docling's chat template (Granite roles; an image part is its <image> placeholder).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<image>' -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|end_of_text|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_of_role|>assistant<|end_of_role|>' -}}{%- endif -%}"
)

TILE = 32
PATCH = 4
SCALE_FACTOR = 4
MAX_PATCHES = 4
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2
DEEPSTACK = [0, 2]
ROPE_THETA = 7_000.0  # far from the default 10000
# Sampling defaults the Hub layout's generation_config.json carries.
SAMPLING = {"do_sample": True, "temperature": 0.4, "top_p": 0.9, "top_k": 30}


def build_tokenizer():
    return build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<|end_of_text|>",
        pad_token="<|pad|>",
    )


def build_image_processor(**options):
    from transformers import GraniteDoclingImageProcessorPil

    return GraniteDoclingImageProcessorPil(
        size={"height": TILE, "width": TILE}, max_patches=MAX_PATCHES,
        image_mean=[0.5] * 3, image_std=[0.5] * 3, **options,
    )


def build_processor(tokenizer, image_processor):
    from transformers import GraniteDoclingProcessor

    return GraniteDoclingProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                   image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)


def reference_processor(tiny: TinyModel, **image_options):
    """transformers' processor over the tiny model's in-memory parts (``image_options``:
    the image processor's settings, such as ``fine_route``)."""
    image_processor = build_image_processor(**image_options) if image_options else tiny.image_processor
    return build_processor(tiny.tokenizer, image_processor)


def _config(tokenizer):
    from transformers import GraniteDoclingConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        initializer_range=INIT_RANGE,
        # Granite's scalings, away from 1 so that a port leaving one out fails
        embedding_multiplier=3.0, logits_scaling=2.5, residual_multiplier=0.5,
        attention_multiplier=0.3,
        bos_token_id=ids["<|end_of_text|>"], eos_token_id=ids["<|end_of_text|>"],
        pad_token_id=ids["<|pad|>"],
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                  image_size=TILE, patch_size=PATCH, out_hidden_size=64, scale_factor=SCALE_FACTOR,
                  deepstack_visual_indexes=DEEPSTACK, use_fine_route=True,
                  initializer_range=INIT_RANGE)
    return GraniteDoclingConfig(text_config=text, vision_config=vision,
                                image_token_id=ids["<image>"], pad_token_id=ids["<|pad|>"],
                                tie_word_embeddings=True)


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import GraniteDoclingForConditionalGeneration

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = GraniteDoclingForConditionalGeneration(_config(tokenizer)).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    eos = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    model.generation_config.bos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|pad|>")
    return TinyModel(family, model, tokenizer, build_image_processor())


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    if layout == "transformers":
        build_processor(tiny.tokenizer, tiny.image_processor).save_pretrained(directory)
    elif layout == "hub":
        _add_prediction_head(directory)
        generation = json.loads((directory / "generation_config.json").read_text())
        (directory / "generation_config.json").write_text(json.dumps({**generation, **SAMPLING}, indent=2))
        _save_hub_processor_files(tiny, directory)
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    return directory


def _add_prediction_head(directory: Path) -> None:
    """The ``mtp.*`` tensors the Hub's checkpoint carries beside the model."""
    import numpy as np
    from safetensors.numpy import load_file

    weights = load_file(str(directory / "model.safetensors"))
    rng = np.random.default_rng(0)
    weights["mtp.layers.0.input_layernorm.weight"] = np.ones(64, np.float32)
    weights["mtp.layers.0.self_attn.q_proj.weight"] = rng.normal(0, 0.2, (64, 64)).astype(np.float32)
    weights["mtp.norm.weight"] = np.ones(64, np.float32)
    write_safetensors(weights, directory)


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    preprocessor = {
        "image_processor_type": "GraniteDoclingImageProcessor", "processor_class": "GraniteDoclingProcessor",
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "crop_to_patches": True, "min_patches": 1, "max_patches": MAX_PATCHES,
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 3, "rescale_factor": 1 / 255,
        "size": {"height": TILE, "width": TILE},
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (directory / "processor_config.json").write_text(json.dumps(
        {"image_seq_len": IMAGE_SEQ_LEN, "processor_class": "GraniteDoclingProcessor"}, indent=2))
    tiny.tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
