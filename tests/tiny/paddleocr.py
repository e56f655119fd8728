"""A tiny PaddleOCR-VL, built offline, for parity tests against transformers.

``PaddleOCRVLForConditionalGeneration`` with random float32 weights: a 2-block NaViT
tower (heads of 16, a 4x4 learned position table resampled to every image's grid), the
projector, and a 2-layer ERNIE-4.5 decoder with M-RoPE whose heads (4 of 32) are not
``hidden_size / heads`` wide. The tokenizer is a byte-level BPE one with ERNIE's special
tokens and a template written after PaddleOCR-VL's: it opens with
``<|begin_of_sentence|>`` itself, turns are ``User: ...\\n`` and ``Assistant: ...</s>``,
a user turn's images come before its text. The tokenizer adds no special tokens.

Layouts:

``"transformers"``
    ``config.json`` as transformers 5 writes it (``text_config`` with
    ``rope_parameters``), tensors named by the module tree (``model.visual.vision_model.*``,
    ``model.projector.*``, ``model.language_model.*``; no ``lm_head`` as it is tied), the
    processor saved by transformers (the tokenizer names its ``image_token``).
``"hub"``
    PaddlePaddle/PaddleOCR-VL's: text parameters at the top level, ``rope_theta`` and
    ``rope_scaling: {"mrope_section", "rope_type": "default", "type": "default"}``,
    ``tie_word_embeddings: false`` (transformers ties them all the same), a
    ``vision_config`` with ``model_type: paddleocr_vl``; tensors ``visual.vision_model.*``,
    ``mlp_AR.*``, ``model.*`` and an ``lm_head.weight`` (the embeddings' copy), the
    image processor's limits as ``min_pixels``/``max_pixels``, a tokenizer that does not
    name its image token.
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

FAMILIES = ("paddleocr_vl",)
LAYOUTS = ("transformers", "hub")

IMAGE_TOKEN = "<|IMAGE_PLACEHOLDER|>"
SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "<|begin_of_sentence|>",
    "<|end_of_sentence|>",
    "<|IMAGE_START|>",
    IMAGE_TOKEN,
    "<|IMAGE_END|>",
    "<|VIDEO_PLACEHOLDER|>",
)

CHAT_TEMPLATE = (
    "<|begin_of_sentence|>"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}\n"
    "{% elif message['role'] == 'user' %}User: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n"
    "{% elif message['role'] == 'assistant' %}Assistant: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "</s>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)

TEXT_ROPE_THETA = 5000.0  # far from the default 5e5: reading the wrong key changes the logits
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112


def build_tokenizer():
    return build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="</s>", pad_token="<unk>",
        bos_token="<s>", extra_special_tokens={"image_token": IMAGE_TOKEN},
    )


def build_image_processor():
    from transformers import PaddleOCRVLImageProcessorPil

    return PaddleOCRVLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )


def build_processor(tokenizer, image_processor):
    from transformers import PaddleOCRVLProcessor

    return PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                chat_template=CHAT_TEMPLATE)


def reference_processor(tiny: TinyModel):
    return build_processor(tiny.tokenizer, tiny.image_processor)


def _config(tokenizer):
    from transformers import PaddleOCRVLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA,
                         "mrope_section": [4, 6, 6]},
        initializer_range=INIT_RANGE,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<unk>"],
        tie_word_embeddings=True,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=56, patch_size=14,
                  initializer_range=INIT_RANGE)
    return PaddleOCRVLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        image_token_id=ids[IMAGE_TOKEN], video_token_id=ids["<|VIDEO_PLACEHOLDER|>"],
        vision_start_token_id=ids["<|IMAGE_START|>"], vision_end_token_id=ids["<|IMAGE_END|>"],
    )


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import PaddleOCRVLForConditionalGeneration

    tokenizer = build_tokenizer()
    config = _config(tokenizer)
    torch.manual_seed(seed)
    model = PaddleOCRVLForConditionalGeneration(config).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    model.generation_config.bos_token_id = tokenizer.convert_tokens_to_ids("<s>")
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("</s>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<unk>")
    return TinyModel(family, model, tokenizer, build_image_processor())


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    state = {k: v.detach().cpu().numpy() for k, v in tiny.model.state_dict().items()}
    if layout == "transformers":
        state.pop("lm_head.weight")
        build_processor(tiny.tokenizer, tiny.image_processor).save_pretrained(directory)
        weights = state
    elif layout == "hub":
        weights = {_hub_name(k): v for k, v in state.items()}
        weights["lm_head.weight"] = np.array(weights["model.embed_tokens.weight"])
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
        _save_hub_processor_files(tiny, directory)
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    write_safetensors(weights, directory)
    return directory


def _hub_name(name: str) -> str:
    for tree, hub in (("model.visual.", "visual."), ("model.projector.", "mlp_AR."),
                      ("model.language_model.", "model.")):
        if name.startswith(tree):
            return hub + name[len(tree):]
    return name


_V5_ONLY_TEXT_KEYS = ("model_type", "rope_parameters", "dtype", "tie_word_embeddings")


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the layout of PaddlePaddle/PaddleOCR-VL's."""
    text = config["text_config"]
    rope = text["rope_parameters"]
    hub = {k: v for k, v in config.items()
           if k not in ("text_config", "vision_config", "dtype", "transformers_version")}
    hub.update({k: v for k, v in text.items() if k not in _V5_ONLY_TEXT_KEYS})
    hub["rope_theta"] = rope["rope_theta"]
    hub["rope_scaling"] = {"mrope_section": list(rope["mrope_section"]),
                           "rope_type": "default", "type": "default"}
    hub["tie_word_embeddings"] = False
    hub["use_3d_rope"] = True
    hub["torch_dtype"] = "float32"
    hub["transformers_version"] = "4.55.0"
    vision = {k: v for k, v in config["vision_config"].items()
              if k not in ("rope_parameters", "dtype", "transformers_version")}
    vision["model_type"] = "paddleocr_vl"
    vision["architectures"] = ["SiglipVisionModel"]
    hub["vision_config"] = vision
    return hub


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    image_processor = tiny.image_processor
    preprocessor = {
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "patch_size": image_processor.patch_size,
        "temporal_patch_size": image_processor.temporal_patch_size,
        "merge_size": image_processor.merge_size,
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
        "image_processor_type": "PaddleOCRVLImageProcessor",
        "processor_class": "PaddleOCRVLProcessor",
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    # The Hub's tokenizer does not name an image token: the loader supplies it.
    tokenizer = build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="</s>", pad_token="<unk>",
        bos_token="<s>",
    )
    tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
