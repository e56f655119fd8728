"""Tiny GLM-4.6V-Flash (``glm4v``, dense) and GLM-4.6V (``glm4v_moe``) checkpoints, built
offline from transformers' own classes with random float32 weights.

Both: a 2-block GLM-V tower (heads of 16, a 6 x 6 learned position table resampled
bicubically to each image's grid, the 2 x 2 merging convolution and the projector) and a
2-layer decoder whose heads (32 wide) turn half their dimensions by M-RoPE in sections
[4, 2, 2]: in adjacent pairs (dense, GLM-4's four-norm blocks), or in halves (MoE: a
dense first layer, then 4 routed experts, 2 per token, with the router's correction bias
and a shared expert).

The tokenizer is byte-level BPE with GLM's special tokens (``[gMASK]``, ``<sop>``, the
role tokens, ``<|begin_of_image|>`` ...) and ``<think>``/``</think>`` as ordinary added
tokens, as the Hub's are; it adds no special tokens (the template writes
``[gMASK]<sop>``). The chat template is written after GLM-4.6V's: roles as
``<|user|>\\n``, images as ``<|begin_of_image|><|image|><|end_of_image|>``, an assistant
turn as ``<|assistant|>\\n<think>reasoning</think>\\ncontent``, ``enable_thinking=False``
adds ``/nothink`` and an empty thinking block. Tools as GLM-4.6V's template renders them:
their JSON in a ``# Tools`` system turn that teaches the call format, an assistant's calls
as ``\\n<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...
</tool_call>`` (a string value as it is, others as JSON), results after
``<|observation|>`` as ``\\n<tool_response>\\n...\\n</tool_response>`` (the call tags are
ordinary added tokens). The processor is transformers'
``Glm46VProcessor`` (as the Hub's checkpoints name it) over the PIL image processor and
the torchvision video processor (a 3 s clip's 18 frames fit at 28 x 56).

Layouts:

``"transformers"``
    what transformers 5's ``save_pretrained`` writes (config, weights, processor).
``"hub"``
    as zai-org's checkpoints: ``text_config`` carrying ``rope_theta``,
    ``partial_rotary_factor`` and ``rope_scaling: {"type": "default", "mrope_section"}``
    instead of ``rope_parameters``, ``torch_dtype``, the vision config's ``model_type``
    the family's; the MoE's experts one tensor each (``mlp.experts.E.gate_proj.weight``)
    and its multi-token-prediction layer (``layers.2.*``) that transformers ignores; the
    image processor's ``preprocessor_config.json`` naming ``Glm46VProcessor``, the
    template in ``chat_template.jinja``, the video processor's settings in
    ``video_preprocessor_config.json``, sampling values in ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny.common import (
    INIT_RANGE,
    TinyModel,
    build_bpe_tokenizer,
    one_tensor_per_expert,
    perturb_constants,
    write_safetensors,
)

FAMILIES = ("glm4v", "glm4v_moe")
LAYOUTS = ("transformers", "hub")

SPECIAL_TOKENS = (
    "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
    "<|end_of_video|>", "<|image|>", "<|video|>", "<|begin_of_box|>", "<|end_of_box|>",
)
THINK_TOKENS = ("<think>", "</think>")
# the Hub's generation_config.json ends an answer at any of these
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")

# GLM's tool-call tags: ordinary added tokens (decoded as text), as the Hub's are
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>")

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools -%}"
    "{{- '<|system|>\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) + '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\n\\nFor each function call, output the function name and arguments within "
    "the following XML format:\\n<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>"
    "\\n<arg_value>{arg-value-1}</arg_value>\\n<arg_key>{arg-key-2}</arg_key>\\n"
    "<arg_value>{arg-value-2}</arg_value>\\n...\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|begin_of_image|><|image|><|end_of_image|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{- '<|begin_of_video|><|video|><|end_of_video|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set no_think = enable_thinking is defined and not enable_thinking -%}"
    "{%- for message in messages -%}"
    "{%- set content = render(message['content']) | string -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set reasoning = message.get('reasoning_content') or '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() -%}"
    "{%- set content = content.split('</think>')[-1].lstrip() -%}"
    "{%- endif -%}"
    "{{- '<|assistant|>\\n<think>' + reasoning + '</think>\\n' + content.strip() -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "{{- '\\n<tool_call>' + call['name'] + '\\n' -}}"
    "{%- for key, value in call['arguments'].items() -%}"
    "{{- '<arg_key>' + key + '</arg_key>\\n<arg_value>' -}}"
    "{{- value if value is string else value | tojson(ensure_ascii=False) -}}"
    "{{- '</arg_value>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '<|user|>\\n' + content -}}{%- if no_think -%}{{- '/nothink' -}}{%- endif -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|observation|>' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>\\n' + content -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>' -}}{%- if no_think -%}{{- '\\n<think></think>' -}}{%- endif -%}"
    "{%- endif -%}"
)

TEXT_ROPE_THETA = 5000.0  # far from the default 1e4: reading the wrong key changes the logits
MIN_PIXELS = 2 * 28 * 28 * 2  # the image processor counts 2 frames per image
MAX_PIXELS = 2 * 112 * 112
# a whole video's pixels: a 3 s clip's 18 frames at 28 x 56
VIDEO_MAX_PIXELS = 18 * 28 * 56
MROPE_SECTION = [4, 2, 2]
# sampling values a GLM-4.6V-Flash generation_config.json sets (as LM Studio shows them)
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.8, "top_p": 0.6, "top_k": 2}
# Half the shared range: with the full one the tower's features grow large enough that
# float32 rounding moves the logits past 1e-4 (the tower itself agrees to 1e-6 relative).
GLM_INIT_RANGE = INIT_RANGE / 2


def build_tokenizer():
    tokenizer = build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_tokens(list(THINK_TOKENS))  # ordinary added tokens: decoded as text
    tokenizer.add_tokens(list(TOOL_TOKENS))
    return tokenizer


def build_image_processor():
    from transformers import Glm46VImageProcessorPil

    return Glm46VImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )


def build_video_processor():
    """transformers' own (torchvision) video processor: the reference's, and saved with
    the checkpoint as the Hub's carry it."""
    from transformers import Glm46VVideoProcessor

    return Glm46VVideoProcessor(size={"shortest_edge": MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS})


def build_processor(tokenizer, image_processor):
    from transformers import Glm46VProcessor

    return Glm46VProcessor(image_processor=image_processor, tokenizer=tokenizer,
                           video_processor=build_video_processor(), chat_template=CHAT_TEMPLATE)


def _config(family: str, tokenizer):
    from transformers import Glm4vConfig, Glm4vMoeConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA,
                         "mrope_section": MROPE_SECTION, "partial_rotary_factor": 0.5},
        initializer_range=GLM_INIT_RANGE,
        eos_token_id=[ids[t] for t in EOS_TOKENS],
        pad_token_id=ids["<|endoftext|>"],
    )
    if family == "glm4v_moe":
        text.update(head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                    moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
                    routed_scaling_factor=1.5, norm_topk_prob=True)
    vision = dict(depth=2, hidden_size=32, num_heads=2, out_hidden_size=128,
                  intermediate_size=96, image_size=84, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, rms_norm_eps=1e-5, initializer_range=GLM_INIT_RANGE)
    config_class = Glm4vMoeConfig if family == "glm4v_moe" else Glm4vConfig
    return config_class(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
    )


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Glm4vForConditionalGeneration, Glm4vMoeForConditionalGeneration

    tokenizer = build_tokenizer()
    config = _config(family, tokenizer)
    if family == "glm4v_moe":
        # the shared seed (2) leaves one of the MoE's answers a near tie (below 1e-3);
        # seed 5 decides every parity prompt's 24 tokens by margins above 2e-3
        seed += 3
    torch.manual_seed(seed)
    model_class = (Glm4vMoeForConditionalGeneration if family == "glm4v_moe"
                   else Glm4vForConditionalGeneration)
    model = model_class(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    perturb_constants(model, generator)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the router's, zero at init
                buffer.add_(0.5 * torch.randn(buffer.shape, generator=generator))
    eos = [tokenizer.convert_tokens_to_ids(t) for t in EOS_TOKENS]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos[0]
    return TinyModel(family, model, tokenizer, build_image_processor())


def reference_processor(tiny: TinyModel):
    return build_processor(tiny.tokenizer, tiny.image_processor)


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    build_processor(tiny.tokenizer, tiny.image_processor).save_pretrained(directory)
    if layout == "transformers":
        return directory
    if layout != "hub":
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    from safetensors.numpy import load_file

    weights = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    if tiny.family == "glm4v_moe":
        weights = one_tensor_per_expert(weights)
        weights.update(_mtp_layer(weights, config))
    (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
    image_processor = tiny.image_processor
    preprocessor = {
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "do_rescale": True,
        "patch_size": image_processor.patch_size,
        "temporal_patch_size": image_processor.temporal_patch_size,
        "merge_size": image_processor.merge_size,
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
        "image_processor_type": "Glm46VImageProcessor",
        "processor_class": "Glm46VProcessor",
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    processor_config = directory / "processor_config.json"
    video = json.loads(processor_config.read_text()).get("video_processor") or {}
    processor_config.unlink()  # the Hub's carry the video settings in a file of their own
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    generation = json.loads((directory / "generation_config.json").read_text())
    generation.update(GENERATION_DEFAULTS)
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_safetensors(weights, directory)
    return directory


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the layout of zai-org's GLM-V checkpoints."""
    hub = {k: v for k, v in config.items() if k != "dtype"}
    text = {k: v for k, v in config["text_config"].items() if k not in ("rope_parameters", "dtype")}
    rope = config["text_config"]["rope_parameters"]
    text["rope_theta"] = rope["rope_theta"]
    text["partial_rotary_factor"] = rope["partial_rotary_factor"]
    text["rope_scaling"] = {"type": "default", "mrope_section": list(rope["mrope_section"])}
    hub["text_config"] = text
    vision = {k: v for k, v in config["vision_config"].items() if k not in ("rope_parameters", "dtype")}
    vision["model_type"] = config["model_type"]
    hub["vision_config"] = vision
    hub["torch_dtype"] = "float32"
    return hub


def _mtp_layer(weights: dict, config: dict) -> dict:
    """A multi-token-prediction layer after the last one, as GLM-4.5V/4.6V ship it."""
    text = config["text_config"]
    last, extra = text["num_hidden_layers"] - 1, text["num_hidden_layers"]
    prefix = "model.language_model.layers."
    layer = {f"{prefix}{extra}.{name[len(f'{prefix}{last}.'):]}": np.array(value)
             for name, value in weights.items() if name.startswith(f"{prefix}{last}.")}
    hidden = text["hidden_size"]
    layer[f"{prefix}{extra}.eh_proj.weight"] = np.zeros((hidden, 2 * hidden), np.float32)
    layer[f"{prefix}{extra}.enorm.weight"] = np.ones(hidden, np.float32)
    return layer
