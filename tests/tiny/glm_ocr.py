"""A tiny GLM-OCR (``glm_ocr``) checkpoint, built offline from transformers'
``GlmOcrForConditionalGeneration`` with random float32 weights.

A 2-block GLM-OCR tower (heads of 16 with q/k norms, biases on every projection, no
position table, the 2 x 2 merging convolution and a projector ``out_hidden_size * 3``
wide) and a 2-layer decoder whose heads are the config's ``head_dim`` (48, not 128 / 4:
a loader dividing the width gets other shapes) turned whole in adjacent pairs by M-RoPE
in sections [8, 8, 8], with GLM-4's four-norm blocks and no attention biases.

The tokenizer is GLM-4.6V's tiny one (tests/tiny/glm4v.py: byte-level BPE, GLM's special
tokens, no special tokens added) with a chat template written after GLM-OCR's: no
thinking block, the generation prompt ``<|assistant|>\\n``. The processor is transformers'
``Glm46VProcessor``, which the Hub's preprocessor_config.json names.

Layouts:

``"transformers"``
    what transformers 5's ``save_pretrained`` writes (config, weights, processor).
``"hub"``
    as zai-org/GLM-OCR: the config with ``num_nextn_predict_layers: 1`` and its
    multi-token-prediction layer's weights (``layers.2.*``, which transformers ignores),
    ``preprocessor_config.json`` naming ``Glm46VProcessor``, the video settings in
    ``video_preprocessor_config.json``, the template in ``chat_template.jinja``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors
from tiny.glm4v import (
    EOS_TOKENS,
    GLM_INIT_RANGE,
    MAX_PIXELS,
    MIN_PIXELS,
    SPECIAL_TOKENS,
    THINK_TOKENS,
    _mtp_layer,
    build_image_processor,
    build_video_processor,
)

FAMILIES = ("glm_ocr",)
LAYOUTS = ("transformers", "hub")

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|begin_of_image|><|image|><|end_of_image|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{- '<|begin_of_video|><|video|><|end_of_video|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

HEAD_DIM = 48
MROPE_SECTION = [8, 8, 8]  # HEAD_DIM / 2 pairs, all turned
TEXT_ROPE_THETA = 5000.0  # far from the default 1e4: reading the wrong key changes the logits


def build_tokenizer():
    tokenizer = build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_tokens(list(THINK_TOKENS))  # the Hub's tokenizer has them as text
    return tokenizer


def build_processor(tokenizer, image_processor):
    from transformers import Glm46VProcessor

    return Glm46VProcessor(image_processor=image_processor, tokenizer=tokenizer,
                           video_processor=build_video_processor(), chat_template=CHAT_TEMPLATE)


def _config(tokenizer):
    from transformers import GlmOcrConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA,
                         "mrope_section": MROPE_SECTION, "partial_rotary_factor": 1.0},
        initializer_range=GLM_INIT_RANGE,
        eos_token_id=[ids[t] for t in EOS_TOKENS],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(depth=2, hidden_size=32, num_heads=2, out_hidden_size=128,
                  intermediate_size=96, image_size=84, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, rms_norm_eps=1e-5, attention_bias=True,
                  initializer_range=GLM_INIT_RANGE)
    return GlmOcrConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
    )


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import GlmOcrForConditionalGeneration

    tokenizer = build_tokenizer()
    # the shared seed (2) ends the text answer after 21 tokens; seed 4 gives every 24-token
    # case and the 64-token task prompts their full length, margins at least 2e-3
    seed += 2
    torch.manual_seed(seed)
    model = GlmOcrForConditionalGeneration(_config(tokenizer)).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    eos = [tokenizer.convert_tokens_to_ids(t) for t in EOS_TOKENS]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos[0]
    return TinyModel(family, model, tokenizer, build_image_processor())


def reference_processor(tiny: TinyModel):
    return build_processor(tiny.tokenizer, tiny.image_processor)


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
    weights.update(_mtp_layer(weights, config))
    config["text_config"]["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config, indent=2))
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
    processor_config.unlink()
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    write_safetensors(weights, directory)
    return directory
