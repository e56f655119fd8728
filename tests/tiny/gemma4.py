"""Tiny Gemma 4 checkpoints (see tests/tiny/__init__.py).

Two families of tiny models, both ``model_type: gemma4``:

``"gemma4"``
    Shaped like google/gemma-4-E2B-it (MatFormer-style "effective" model): per-layer
    inputs (PLE), the last two layers sharing the KV of the last sliding and the last
    global layer before them, double-wide MLPs in those layers, final-logit soft-capping,
    global layers with their own head size and proportional (partial) rope, a vision
    tower with clipped linears and standardized soft tokens, and E2B's audio conformer.
``"gemma4_moe"``
    Shaped like google/gemma-4-26B-A4B-it: a mixture-of-experts block beside the dense MLP
    in every layer, global layers whose keys are their values (``attention_k_eq_v``) with
    their own KV-head count, bidirectional attention among an image's tokens in the
    sliding layers, no per-layer inputs.

Layouts:

``"transformers"``
    What transformers 5's ``save_pretrained`` writes (``per_layer_config`` in the text
    config, ``model.language_model.*`` names, ``processor_config.json``).
``"hub"``
    google/gemma-4-*-it's layout: the text config names ``global_head_dim`` and
    ``num_global_key_value_heads`` and no ``per_layer_config``; tensors as transformers
    4.x names them (``model.language_model.*``, no ``lm_head``); the chat template in
    ``chat_template.jinja`` and the image processor in ``preprocessor_config.json``.

The sliding window (16) is shorter than every prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants

FAMILIES = ("gemma4", "gemma4_moe")
LAYOUTS = ("transformers", "hub")

SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
    "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>",
    "<|tool_call>", "<tool_call|>", '<|"|>',
)
EXTRA_SPECIAL_TOKENS = {
    "boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
    "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>",
}

# Gemma 4's chat template as the Hub's carries it, less tools and thought parsing:
# ``enable_thinking`` opens a system turn with <|think|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- if thinking or messages[0]['role'] == 'system' -%}"
    "<|turn>system\n{% if thinking %}<|think|>{% endif %}"
    "{%- if messages[0]['role'] == 'system' -%}{{ messages[0]['content'] | trim }}{%- endif -%}"
    "<turn|>\n"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'system' -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "<|turn>{{ role }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}<|image|>"
    "{%- elif item['type'] == 'audio' -%}<|audio|>"
    "{%- elif item['type'] == 'video' -%}<|video|>"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<turn|>\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|turn>model\n{%- endif -%}"
)

PATCH_SIZE = 8
POOLING = 2
MAX_SOFT_TOKENS = 70  # the smallest budget Gemma 4's image processor takes
SLIDING_WINDOW = 16
# transformers' Gemma4VideoProcessor settings: four frames by count, the image budget
VIDEO_PROCESSOR = {"video_processor_type": "Gemma4VideoProcessor", "num_frames": 4,
                   "patch_size": PATCH_SIZE, "max_soft_tokens": MAX_SOFT_TOKENS,
                   "pooling_kernel_size": POOLING}


def build_tokenizer():
    return build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<eos>", pad_token="<pad>",
        bos_token="<bos>", extra_special_tokens=EXTRA_SPECIAL_TOKENS,
    )


def build_image_processor():
    from transformers import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(patch_size=PATCH_SIZE, max_soft_tokens=MAX_SOFT_TOKENS,
                                   pooling_kernel_size=POOLING)


def build_feature_extractor():
    from transformers import Gemma4AudioFeatureExtractor

    return Gemma4AudioFeatureExtractor()


def build_processor(tokenizer, image_processor=None, feature_extractor=None):
    from transformers import Gemma4Processor

    from mlxvlm.models.gemma4_video import Gemma4VideoProcessor
    from mlxvlm.models.processor_utils import image_only

    return image_only(Gemma4Processor)(
        image_processor=image_processor or build_image_processor(),
        feature_extractor=feature_extractor or build_feature_extractor(),
        video_processor=Gemma4VideoProcessor(**VIDEO_PROCESSOR), tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def reference_processor(tiny: TinyModel):
    return build_processor(tiny.tokenizer, tiny.image_processor)


def _ids(tokenizer) -> dict:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def _text_config(family: str, tokenizer) -> dict:
    ids = _ids(tokenizer)
    vocab = (len(tokenizer) + 15) // 16 * 16
    common = dict(
        vocab_size=vocab, hidden_size=48, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, global_head_dim=64, sliding_window=SLIDING_WINDOW,
        max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 20_000.0},
        },
        initializer_range=INIT_RANGE, pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"],
        eos_token_id=[ids["<eos>"], ids["<turn|>"]],
    )
    if family == "gemma4":
        return dict(
            common, num_hidden_layers=6, intermediate_size=64,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention", "sliding_attention", "full_attention"],
            num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=vocab, final_logit_softcapping=30.0,
        )
    return dict(
        common, num_hidden_layers=4, intermediate_size=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=True,
        num_global_key_value_heads=2, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, use_bidirectional_attention="vision",
        final_logit_softcapping=30.0,
    )


def _audio_config() -> dict:
    """E2B's conformer, narrow and two blocks deep, with a short attention window (chunks
    of 4 frames, 5 frames of left context) so that a second of sound spans many windows.
    The first convolution keeps 128 channels: the projection after the two convolutions
    reads (channels // 4) x (second channels) features, which must be (128 mels // 4) x
    (second channels)."""
    return dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        subsampling_conv_channels=[128, 8], conv_kernel_size=5, attention_chunk_size=4,
        attention_context_left=6, attention_context_right=0, attention_logit_cap=50.0,
        output_proj_dims=24, use_clipped_linears=True, initializer_range=INIT_RANGE,
    )


def _config(family: str, tokenizer):
    from transformers import Gemma4Config

    ids = _ids(tokenizer)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, patch_size=PATCH_SIZE, pooling_kernel_size=POOLING,
        position_embedding_size=64, use_clipped_linears=family == "gemma4",
        standardize=family == "gemma4", rope_parameters={"rope_type": "axial", "rope_theta": 50.0},
        initializer_range=INIT_RANGE,
    )
    return Gemma4Config(
        text_config=_text_config(family, tokenizer), vision_config=vision,
        audio_config=_audio_config() if family == "gemma4" else None,
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"],
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"], initializer_range=INIT_RANGE,
    )


def _randomize_buffers(model, generator) -> None:
    """The vision tower's clipping bounds (infinite by default) and its standardization
    (empty), set to values that matter."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-1.5 - torch.rand((), generator=generator).item())
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(1.5 + torch.rand((), generator=generator).item())
            elif name.endswith("std_bias"):
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("std_scale"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))
            elif name.endswith("layer_scalar"):
                buffer.copy_(0.8 + 0.4 * torch.rand(buffer.shape, generator=generator))


def _soften_text_attention(model, factor: float) -> None:
    """Scale the text layers' q/k norm weights down by ``factor``. Gemma 4's attention has no 1/sqrt(d)
    scale (the norms stand in for it), so with norm weights near 1 a random tiny model's
    attention is so peaked that float32 rounding alone moves its logits by ~1e-4 (torch's
    against float64 as much as ours), and the MoE model's answer ignores its image; scaled
    down, both stay well inside the tolerance and the image decides the answer."""
    import torch

    with torch.no_grad():
        for name, param in model.model.language_model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.mul_(factor)


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Gemma4ForConditionalGeneration

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(_config(family, tokenizer)).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    perturb_constants(model, generator)
    _randomize_buffers(model, generator)
    _soften_text_attention(model, 0.5 if family == "gemma4" else 0.35)
    ids = _ids(tokenizer)
    model.generation_config.bos_token_id = ids["<bos>"]
    model.generation_config.eos_token_id = [ids["<eos>"], ids["<turn|>"]]
    model.generation_config.pad_token_id = ids["<pad>"]
    return TinyModel(family, model, tokenizer, build_image_processor())


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    tiny.tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    image_processor = json.loads(tiny.image_processor.to_json_string())
    feature_extractor = json.loads(build_feature_extractor().to_json_string())
    if layout == "transformers":
        processor = {"image_processor": image_processor, "feature_extractor": feature_extractor,
                     "video_processor": VIDEO_PROCESSOR, "processor_class": "Gemma4Processor"}
        (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))
        return directory
    if layout != "hub":
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
    preprocessor = {**image_processor, **feature_extractor, "processor_class": "Gemma4Processor"}
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (directory / "video_preprocessor_config.json").write_text(json.dumps(
        {**VIDEO_PROCESSOR, "processor_class": "Gemma4Processor"}, indent=2))
    return directory


def hub_config(config: dict) -> dict:
    """transformers 5.24's config.json -> google/gemma-4-*-it's: the global layers' head
    size and KV heads as ``global_head_dim`` / ``num_global_key_value_heads``."""
    config = json.loads(json.dumps(config))
    text = config["text_config"]
    per_layer = text.pop("per_layer_config", None) or {}
    overrides = next(iter(per_layer.values()), {}) if per_layer else {}
    text["global_head_dim"] = overrides.get("head_dim", text["head_dim"])
    if "num_key_value_heads" in overrides:
        text["num_global_key_value_heads"] = overrides["num_key_value_heads"]
    config["transformers_version"] = "4.57.0.dev0"
    return config
