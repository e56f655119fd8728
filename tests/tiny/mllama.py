"""Tiny Llama 3.2 Vision (``mllama``) checkpoints (see tests/tiny/__init__.py), in two
layouts:

``"transformers"``
    What transformers 5's ``save_pretrained`` writes for the model and the processor:
    tensors under the module tree (``model.vision_model.*``, ``model.language_model.*``,
    ``model.multi_modal_projector.*``, ``lm_head.*``), ``rope_parameters`` in the text
    config, the image processor's settings in ``processor_config.json``.
``"hub"``
    meta-llama/Llama-3.2-11B-Vision-Instruct's layout: tensors named ``vision_model.*``,
    ``language_model.model.*``, ``language_model.lm_head.*`` and
    ``multi_modal_projector.*``; ``rope_scaling`` (llama3) and ``rope_theta`` in the text
    config; ``preprocessor_config.json``; the chat template in ``chat_template.json``; a
    ``generation_config.json`` that samples (temperature 0.6, top-p 0.9) as the release's.

The tokenizer behaves as the Hub's: its ``tokenizer.json`` post-processor prepends
``<|begin_of_text|>`` and the chat template starts with ``{{- bos_token }}``;
``<|image|>`` is the last token, its id the text model's ``vocab_size`` (the embedding
has 8 rows more, the head none for it), as in the release. Each tile is 28 pixels, 2 x 2
patches and a class token: 5 positions, padded to 8 inside the tower as transformers
pads 1601 to 1608.
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

FAMILIES = ("mllama",)
LAYOUTS = ("transformers", "hub")

BOS = "<|begin_of_text|>"
SPECIAL_TOKENS = (
    BOS, "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    "<|image|>",  # last: its id is the text model's vocab_size
)

# Llama 3.2 Vision Instruct's template, less its tool-calling and date preamble (the
# release writes no system turn for a chat with images and none given).
CHAT_TEMPLATE = (
    "{{ bos_token }}"  # (the release writes {{- bos_token }}: the same at the start)
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif content['type'] == 'text' %}{{- content['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

TILE_SIZE = 28
PATCH_SIZE = 14
MAX_TILES = 4
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 10_000.0}
SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}


def build_tokenizer():
    from tokenizers import processors

    tokenizer = build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>", bos_token=BOS,
    )
    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


def build_processor(tokenizer, image_processor=None):
    from transformers import MllamaImageProcessorPil, MllamaProcessor

    image_processor = image_processor or MllamaImageProcessorPil(
        size={"height": TILE_SIZE, "width": TILE_SIZE}, max_image_tiles=MAX_TILES,
    )
    return MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                           chat_template=CHAT_TEMPLATE)


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts."""
    return build_processor(tiny.tokenizer, tiny.image_processor)


def _ids(tokenizer) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def _config(tokenizer):
    from transformers import MllamaConfig

    ids = _ids(tokenizer)
    image = ids["<|image|>"]
    eos = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    text = dict(
        vocab_size=image, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
        num_attention_heads=2, num_key_value_heads=1, cross_attention_layers=[1, 3],
        rope_parameters=dict(ROPE), max_position_embeddings=1024, rms_norm_eps=1e-5,
        initializer_range=INIT_RANGE, bos_token_id=ids[BOS], eos_token_id=eos,
        pad_token_id=ids["<|finetune_right_pad_id|>"], tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_global_layers=2,
        attention_heads=2, image_size=TILE_SIZE, patch_size=PATCH_SIZE, max_num_tiles=MAX_TILES,
        intermediate_layers_indices=[0, 2], vision_output_dim=32 * 3, norm_eps=1e-5,
        initializer_range=INIT_RANGE,
    )
    return MllamaConfig(text_config=text, vision_config=vision, image_token_index=image)


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import MllamaForConditionalGeneration

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(_config(tokenizer)).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    perturb_constants(model, generator)
    with torch.no_grad():
        # transformers starts most gates at zero (the cross-attention layers and the
        # tiles' embeddings would then do nothing): draw them, small enough that the
        # image does not drown the text.
        for name, param in model.named_parameters():
            if "gate" in name.rsplit(".", 1)[-1]:
                param.copy_(0.2 + 0.3 * torch.rand(param.shape, generator=generator))
    ids = _ids(tokenizer)
    model.generation_config.bos_token_id = ids[BOS]
    model.generation_config.eos_token_id = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    model.generation_config.pad_token_id = ids["<|finetune_right_pad_id|>"]
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
    generation = json.loads((directory / "generation_config.json").read_text())
    generation.update(SAMPLING)
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _save_hub_processor_files(tiny, directory)
    return directory


HUB_NAMES = (
    ("model.vision_model.", "vision_model."),
    ("model.language_model.", "language_model.model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def hub_weights(model) -> dict[str, np.ndarray]:
    """The tensors under the names of meta-llama/Llama-3.2-11B-Vision-Instruct's files."""
    weights = {}
    for name, value in model.state_dict().items():
        for new, old in HUB_NAMES:
            if name.startswith(new):
                name = old + name[len(new):]
                break
        weights[name] = value.detach().cpu().numpy()
    return weights


_HUB_TEXT_KEYS = ("cross_attention_layers", "hidden_act", "hidden_size", "intermediate_size",
                  "max_position_embeddings", "model_type", "num_attention_heads",
                  "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
                  "tie_word_embeddings", "vocab_size", "bos_token_id", "eos_token_id",
                  "pad_token_id", "initializer_range")
_HUB_VISION_KEYS = ("attention_heads", "hidden_act", "hidden_size", "image_size",
                    "intermediate_layers_indices", "intermediate_size", "max_num_tiles",
                    "model_type", "norm_eps", "num_channels", "num_global_layers",
                    "num_hidden_layers", "patch_size", "supported_aspect_ratios",
                    "vision_output_dim", "initializer_range")


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the layout of the release's (transformers 4.45)."""
    text, vision = config["text_config"], config["vision_config"]
    rope = dict(text["rope_parameters"])
    hub_text = {k: text[k] for k in _HUB_TEXT_KEYS}
    hub_text["rope_theta"] = rope.pop("rope_theta")
    hub_text["rope_scaling"] = rope
    hub_text["torch_dtype"] = "float32"
    return {
        "architectures": ["MllamaForConditionalGeneration"],
        "image_token_index": config["image_token_index"],
        "model_type": "mllama",
        "text_config": hub_text,
        "torch_dtype": "float32",
        "transformers_version": "4.45.0.dev0",
        "vision_config": {k: vision[k] for k in _HUB_VISION_KEYS},
    }


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    for name in ("processor_config.json", "chat_template.jinja", "preprocessor_config.json"):
        (directory / name).unlink(missing_ok=True)
    image_processor = tiny.image_processor
    preprocessor = {
        "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True,
        "do_resize": True, "image_mean": list(image_processor.image_mean),
        "image_processor_type": "MllamaImageProcessor",
        "image_std": list(image_processor.image_std), "max_image_tiles": MAX_TILES,
        "processor_class": "MllamaProcessor", "resample": 2, "rescale_factor": 1 / 255,
        "size": {"height": TILE_SIZE, "width": TILE_SIZE},
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    tiny.tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
