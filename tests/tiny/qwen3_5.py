"""Tiny Qwen3.5 and Qwen3.5-MoE checkpoints (hybrid linear attention), built offline.

Four decoder layers alternate Gated DeltaNet linear attention and gated full attention
(linear, full, linear, full), with more value heads than key heads in the linear layers
(transformers repeats the keys) and a quarter of each attention head rotated by
interleaved M-RoPE. The vision tower is Qwen3-VL's without DeepStack.

Layouts (see tests/tiny/qwen.py for the shared parts):

``"transformers"``
    ``config.json`` as transformers 5's ``save_pretrained`` writes it (``layer_types``,
    ``rope_parameters`` with ``partial_rotary_factor``), tensors by the module tree.
``"hub"``
    As the Hub's Qwen/Qwen3.5-* checkpoints are laid out: ``full_attention_interval``
    instead of ``layer_types``, the vision config's ``model_type`` written as the
    family's (transformers overrides it), a multi-token-prediction head ``mtp.*`` beside
    the model's tensors, the image processor's limits as ``size``, and the chat template
    in ``chat_template.json``.

The chat template is Qwen3.5's in shape (written here after the Hub's): the generation
prompt opens a thinking block (``<think>\\n``) unless ``enable_thinking=False`` closes it
empty; an assistant turn after the last user message keeps its reasoning, earlier ones
keep only their answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors
from tiny.qwen import (
    QWEN3_MAX_PIXELS,
    QWEN3_MIN_PIXELS,
    SPECIAL_TOKENS,
    TEXT_ROPE_THETA,
    _module_tree_weights,
    _special_ids,
    build_image_processor,
    write_video_processor_config,
)

FAMILIES = ("qwen3_5", "qwen3_5_moe")
TEXT_INIT_RANGE = INIT_RANGE / 2
LAYOUTS = ("transformers", "hub")

CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(found=false, last_query=messages|length - 1) -%}"
    "{%- for message in messages[::-1] -%}"
    "{%- if not ns.found and message['role'] == 'user' -%}"
    "{%- set ns.found = true -%}{%- set ns.last_query = messages|length - 1 - loop.index0 -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- set content = render(message['content']) | string -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def build_tokenizer():
    return build_bpe_tokenizer(SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _config(family: str, tokenizer):
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    ids = _special_ids(tokenizer)
    token_ids = {k: ids[k] for k in
                 ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    # head_dim 64 with a quarter rotated: 8 rotary frequencies over (t, h, w) as [3, 3, 2]
    # (the released models: 32 as [11, 11, 10]).
    text = dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True,
                         "partial_rotary_factor": 0.25},
        # Half the other tiny models' range: the linear layers' gated outputs grow the
        # residual stream fast, and float32 rounding (transformers' own against float64)
        # then exceeds the 1e-4 logit tolerance.
        initializer_range=TEXT_INIT_RANGE,
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    )
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                  num_heads=2, patch_size=16, num_position_embeddings=16,
                  initializer_range=INIT_RANGE)
    if family == "qwen3_5":
        # Tied embeddings, like the small Qwen3.5 models.
        return Qwen3_5Config(text_config=text, vision_config=vision,
                             tie_word_embeddings=True, **token_ids)
    # 4 experts of width 16, 2 per token, and a shared expert of width 32, in every layer.
    del text["intermediate_size"]
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=32)
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                            tie_word_embeddings=False, **token_ids)


# Picked so that every parity prompt gets 24 greedy tokens with clear top-1/top-2 margins.
_SEED_OFFSET = {"qwen3_5": 5, "qwen3_5_moe": 1}


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    tokenizer = build_tokenizer()
    config = _config(family, tokenizer)
    model_class = {"qwen3_5": Qwen3_5ForConditionalGeneration,
                   "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration}[family]
    seed += _SEED_OFFSET[family]
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    ids = _special_ids(tokenizer)
    model.generation_config.bos_token_id = ids["bos_token_id"]
    model.generation_config.eos_token_id = ids["eos_token_id"]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    return TinyModel(family, model, tokenizer, build_image_processor("qwen3_vl"))


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    weights = _module_tree_weights(tiny.model)
    tiny.tokenizer.save_pretrained(directory)
    if layout == "transformers":
        tiny.image_processor.save_pretrained(directory)
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    elif layout == "hub":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
        weights.update(mtp_weights(weights, config["text_config"], seed=len(tiny.family)))
        _save_hub_processor_files(tiny, directory)
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    write_video_processor_config("qwen3_vl", directory)  # Qwen3.5 ships Qwen3-VL's
    write_safetensors(weights, directory)
    return directory


def mtp_weights(weights: dict[str, np.ndarray], text: dict, seed: int) -> dict[str, np.ndarray]:
    """A random multi-token-prediction head in the Hub's names (``mtp.fc``, the two
    pre-fc norms, ``mtp.layers.0.*`` shaped as the decoder's full-attention layer, MoE
    included, ``mtp.norm``); norms zero-centred as transformers stores them."""
    rng = np.random.default_rng(seed)
    hidden = text["hidden_size"]
    full = text["layer_types"].index("full_attention")
    source = f"model.language_model.layers.{full}."

    def draw(shape, norm=False):
        scale = 0.1 if norm else TEXT_INIT_RANGE
        return rng.normal(scale=scale, size=shape).astype(np.float32)

    head = {f"mtp.layers.0.{name[len(source):]}": draw(value.shape, value.ndim == 1)
            for name, value in weights.items() if name.startswith(source)}
    head["mtp.fc.weight"] = draw((hidden, 2 * hidden))
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        head[f"mtp.{norm}.weight"] = draw((hidden,), norm=True)
    return head


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the layout of the Hub's Qwen3.5 checkpoints."""
    hub = {k: v for k, v in config.items() if k not in ("dtype",)}
    text = {k: v for k, v in config["text_config"].items() if k not in ("layer_types", "dtype")}
    types = config["text_config"]["layer_types"]
    text["full_attention_interval"] = types.index("full_attention") + 1
    text["mtp_num_hidden_layers"] = 1
    hub["text_config"] = text
    vision = {k: v for k, v in config["vision_config"].items() if k != "rope_parameters"}
    vision["model_type"] = config["model_type"]
    hub["vision_config"] = vision
    hub["torch_dtype"] = "float32"
    return hub


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    image_processor = tiny.image_processor
    preprocessor = {
        "size": {"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS},
        "patch_size": image_processor.patch_size,
        "temporal_patch_size": image_processor.temporal_patch_size,
        "merge_size": image_processor.merge_size,
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts (images and text)."""
    import transformers

    from mlxvlm.models.processor_utils import image_only

    return image_only(transformers.Qwen3VLProcessor)(
        image_processor=tiny.image_processor, tokenizer=tiny.tokenizer,
        video_processor=None, chat_template=CHAT_TEMPLATE)
