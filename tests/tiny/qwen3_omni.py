"""A tiny Qwen3-Omni thinker (MoE), built offline, for parity tests against transformers.

The thinker is ``Qwen3OmniMoeThinkerForConditionalGeneration`` with random float32
weights: a 2-block audio encoder (the Conv2d stem over 1 s chunks, attention windows of
two chunks, so that a 2.5 s sound spans two windows), the Qwen3-VL vision tower with one
DeepStack tap, and a 2-layer Qwen3-MoE decoder (4 experts, 2 per token; its first layer
dense through ``mlp_only_layers``) with interleaved M-RoPE and a rope θ that is not the
default. Its tokenizer (``tokenizers`` BPE) carries Qwen3-Omni's special tokens and the
attributes transformers' processor reads (``tokenizer.audio_token`` ...).

Two layouts:

``"transformers"``
    The thinker alone as transformers 5 saves it: ``model_type: qwen3_omni_moe_thinker``,
    tensors named by the module tree (``model.audio_tower.*``, ``model.visual.*``,
    ``model.language_model.*`` with each layer's experts as 3-D tensors, ``lm_head.*``),
    the processor's settings nested in ``processor_config.json``, the chat template in
    ``chat_template.jinja``.
``"hub"``
    The layout of Qwen/Qwen3-Omni-30B-A3B-*: the full model's config (``model_type:
    qwen3_omni_moe`` with ``thinker_config``; ``rope_scaling`` and ``rope_theta``), tensors
    ``thinker.audio_tower.*``, ``thinker.visual.*``, ``thinker.model.*`` (one tensor per
    expert, ``mlp.experts.E.gate_proj``) and ``thinker.lm_head.*`` beside speech-output
    ones (``talker.*``, ``code2wav.*``) the thinker must skip, one flat
    ``preprocessor_config.json`` and ``chat_template.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors
from tiny.omni import omni_tiny, save_processor_files

FAMILIES = ("qwen3_omni_moe",)
LAYOUTS = ("transformers", "hub")

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
OMNI_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# Qwen3-Omni's template, shortened: one block per media part, no default system turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_ROPE_THETA = 5000.0
MIN_PIXELS = 32 * 32
MAX_PIXELS = 128 * 128
# Mel frames of padding the feature extractor adds (transformers' default is 30 s).
CHUNK_SECONDS = 10
# The processor's default (Qwen3OmniMoeProcessor.position_id_per_seconds), as the Hub's
# config has it too.
POSITION_ID_PER_SECONDS = 13


def build_tokenizer():
    return build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", extra_special_tokens=OMNI_TOKENS,
    )


def build_processor_parts():
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    return (Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=16,
                                     image_mean=[0.5] * 3, image_std=[0.5] * 3),
            WhisperFeatureExtractor(feature_size=128, chunk_length=CHUNK_SECONDS,
                                    return_attention_mask=True))


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts, for images, audio
    and text (its video processor needs torchvision)."""
    from transformers import Qwen3OmniMoeProcessor

    from mlxvlm.models.processor_utils import image_only

    return image_only(Qwen3OmniMoeProcessor)(
        image_processor=tiny.image_processor, video_processor=None,
        feature_extractor=tiny.feature_extractor, tokenizer=tiny.tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def _config(tokenizer):
    from transformers import Qwen3OmniMoeThinkerConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA,
                         "mrope_section": [6, 5, 5], "interleaved": True},
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        mlp_only_layers=[0], norm_topk_prob=True,
        initializer_range=INIT_RANGE, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                  num_heads=2, patch_size=16, num_position_embeddings=16,
                  deepstack_visual_indexes=[0], initializer_range=INIT_RANGE)
    # 1 s chunks (n_window 50, as the processor counts tokens); attention windows of two
    # chunks (n_window_infer 200).
    audio = dict(encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=64, n_window=50, n_window_infer=200, downsample_hidden_size=8,
                 num_mel_bins=128, initializer_range=INIT_RANGE)
    return Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio,
        audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], audio_start_token_id=ids["<|audio_start|>"],
        audio_end_token_id=ids["<|audio_end|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], position_id_per_seconds=POSITION_ID_PER_SECONDS,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
    )


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(_config(tokenizer)).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    return omni_tiny(family, model, tokenizer, *build_processor_parts())


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    weights = {name: value.detach().cpu().numpy()
               for name, value in tiny.model.state_dict().items()}
    tiny.tokenizer.save_pretrained(directory)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    # the video processor's settings are the image processor's (16 px patches)
    video = {**tiny.image_processor.to_dict(), "video_processor_type": "Qwen2VLVideoProcessor"}
    save_processor_files(tiny, directory, layout, "Qwen3OmniMoeProcessor", CHAT_TEMPLATE,
                         MIN_PIXELS, MAX_PIXELS, video_processor=video)
    if layout == "hub":
        weights = hub_weights(weights)
        # speech-output tensors the thinker must skip
        weights["talker.codec_head.weight"] = np.zeros((8, 4), np.float32)
        weights["code2wav.pre_transformer.norm.weight"] = np.zeros((4,), np.float32)
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
    write_safetensors(weights, directory)
    return directory


def hub_weights(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Module-tree tensors -> the names and per-expert layout of the Hub's safetensors."""
    hub = {}
    for name, value in weights.items():
        for prefix, legacy in (("model.audio_tower.", "audio_tower."), ("model.visual.", "visual."),
                               ("model.language_model.", "model.")):
            if name.startswith(prefix):
                name = legacy + name[len(prefix):]
                break
        layer, _, kind = name.rpartition(".mlp.experts.")
        if not layer:
            hub["thinker." + name] = value
            continue
        for expert, matrix in enumerate(value):  # (experts, out, in)
            target = f"thinker.{layer}.mlp.experts.{expert}"
            if kind == "gate_up_proj":
                gate, up = np.split(matrix, 2, axis=0)
                hub[f"{target}.gate_proj.weight"] = np.ascontiguousarray(gate)
                hub[f"{target}.up_proj.weight"] = np.ascontiguousarray(up)
            else:
                hub[f"{target}.down_proj.weight"] = np.ascontiguousarray(matrix)
    return hub


def hub_config(thinker: dict) -> dict:
    """transformers 5's thinker config.json -> the Hub's full-model config.json."""
    from transformers import Qwen3OmniMoeConfig

    thinker = {k: v for k, v in thinker.items() if k not in ("dtype", "transformers_version")}
    text = dict(thinker["text_config"])
    rope = text.pop("rope_parameters")
    text["rope_scaling"] = {"mrope_section": rope["mrope_section"], "interleaved": True,
                            "mrope_interleaved": True, "rope_type": "default"}
    text["rope_theta"] = rope["rope_theta"]
    thinker["text_config"] = text
    full = Qwen3OmniMoeConfig(enable_audio_output=False).to_dict()
    full.update(thinker_config=thinker, architectures=["Qwen3OmniMoeForConditionalGeneration"],
                torch_dtype="float32", transformers_version="4.57.0.dev0")
    for key in ("dtype", "talker_config", "code2wav_config"):
        full.pop(key, None)
    return full
