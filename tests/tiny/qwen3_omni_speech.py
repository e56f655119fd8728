"""A tiny full Qwen3-Omni (thinker, talker and code2wav), built offline, for the speech
parity tests against transformers.

``Qwen3OmniMoeForConditionalGeneration`` with ``enable_audio_output=True`` and random
float32 weights. The thinker is tests/tiny/qwen3_omni.py's (2 layers; the talker reads
the hidden states after its first layer, ``accept_hidden_layer`` 1). The talker is a
2-layer MoE decoder (4 experts, 2 per token, a gated shared expert) with interleaved
M-RoPE over a 1088-entry codec vocabulary: 64 codes, then the 1024 special entries
transformers suppresses (codec pad/bos/eos, the think markers and three speakers among
them). The code predictor is a 2-layer dense decoder predicting the other 3 of 4 code
groups. code2wav: 2 transformer layers with an 8-frame sliding window (so that a
sequence of a few dozen frames crosses it), two 2x upsampling stages and a 3x/2x decoder:
24 samples per frame.

One layout, ``"hub"``: the layout of Qwen/Qwen3-Omni-30B-A3B-Instruct: the full config
(``model_type: qwen3_omni_moe`` with ``thinker_config``, ``talker_config`` and
``code2wav_config``; ``rope_scaling`` and ``rope_theta``), tensors ``thinker.*`` as
tests/tiny/qwen3_omni.py writes them, ``talker.*`` with one tensor per expert
(``talker.model.layers.L.mlp.experts.E.gate_proj``) and ``code2wav.*``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny import qwen3_omni
from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors
from tiny.omni import omni_tiny, save_processor_files

FAMILIES = ("qwen3_omni_moe_speech",)
LAYOUTS = ("hub",)

TTS_TOKENS = ("<tts_pad>", "<tts_text_bos>", "<tts_text_eod>")
SPEAKERS = {"ethan": 1080, "chelsie": 1081, "aiden": 1082}
CODEBOOK = 64
CODE_GROUPS = 4
TALKER_VOCAB = CODEBOOK + 1024
CODEC_IDS = dict(codec_pad_id=1070, codec_bos_id=1071, codec_eos_token_id=1072,
                 codec_nothink_id=1073, codec_think_bos_id=1074, codec_think_eos_id=1075)
TALKER_ROPE_THETA = 20000.0
CODE2WAV_ROPE_THETA = 10000.0
SLIDING_WINDOW = 8
CODE2WAV_INIT_RANGE = 0.05


def build_tokenizer():
    return build_bpe_tokenizer(
        qwen3_omni.SPECIAL_TOKENS + TTS_TOKENS, chat_template=qwen3_omni.CHAT_TEMPLATE,
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=qwen3_omni.OMNI_TOKENS,
    )


def _first_token(tokenizer, text: str) -> int:
    return tokenizer.encode(text, add_special_tokens=False)[0]


def _config(tokenizer):
    from transformers import Qwen3OmniMoeConfig

    thinker = qwen3_omni._config(tokenizer).to_dict()
    talker_text = dict(
        vocab_size=TALKER_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": TALKER_ROPE_THETA,
                         "mrope_section": [2, 3, 3], "interleaved": True},
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, norm_topk_prob=True,
        max_position_embeddings=4096, initializer_range=INIT_RANGE,
    )
    code_predictor = dict(
        vocab_size=CODEBOOK, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_code_groups=CODE_GROUPS, max_position_embeddings=64, initializer_range=INIT_RANGE,
    )
    talker = dict(
        text_config=talker_text, code_predictor_config=code_predictor,
        num_code_groups=CODE_GROUPS, thinker_hidden_size=thinker["text_config"]["hidden_size"],
        accept_hidden_layer=1, speaker_id=SPEAKERS, **CODEC_IDS,
        audio_token_id=thinker["audio_token_id"], image_token_id=thinker["image_token_id"],
        video_token_id=thinker["video_token_id"],
        vision_start_token_id=thinker["vision_start_token_id"],
        audio_start_token_id=thinker["audio_start_token_id"],
        position_id_per_seconds=qwen3_omni.POSITION_ID_PER_SECONDS,
        spatial_merge_size=2, initializer_range=INIT_RANGE,
    )
    code2wav = dict(
        codebook_size=CODEBOOK, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
        sliding_window=SLIDING_WINDOW, intermediate_size=48, num_hidden_layers=2,
        num_quantizers=CODE_GROUPS, upsample_rates=[3, 2], upsampling_ratios=[2, 2],
        decoder_dim=16, rms_norm_eps=1e-5, layer_scale_initial_scale=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": CODE2WAV_ROPE_THETA},
        # small weights: a waveform mostly inside [-1, 1], not clipped flat
        max_position_embeddings=4096, initializer_range=CODE2WAV_INIT_RANGE,
    )
    ids = tokenizer.convert_tokens_to_ids
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        enable_audio_output=True, im_start_token_id=ids("<|im_start|>"),
        im_end_token_id=ids("<|im_end|>"), tts_pad_token_id=ids("<tts_pad>"),
        tts_bos_token_id=ids("<tts_text_bos>"), tts_eos_token_id=ids("<tts_text_eod>"),
        system_token_id=_first_token(tokenizer, "system"),
        user_token_id=_first_token(tokenizer, "user"),
        assistant_token_id=_first_token(tokenizer, "assistant"),
    )


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(_config(tokenizer)).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    perturb_constants(model, generator)
    with torch.no_grad():
        # transformers 5.25 leaves the talker's fused expert banks as torch.empty gives
        # them (no init covers them: what memory held, so the model changed with whatever
        # the process had done before) and its routers at zero (every expert tied, so the
        # choice among them was the top-k's tie-break, not the model's)
        for name, param in model.talker.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")):
                param.copy_(INIT_RANGE * torch.randn(param.shape, generator=generator))
        # the snake activations' log-scales and the layer scales off their init, the
        # ConvNeXt scales (1e-6) to where they matter
        for name, param in model.code2wav.named_parameters():
            if name.endswith((".alpha", ".beta")):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith((".gamma", ".scale")):
                param.copy_(0.5 + 0.2 * torch.randn(param.shape, generator=generator))
        # the speakers' codec embeddings loud enough that each voice speaks other codes
        speakers = list(SPEAKERS.values())
        model.talker.model.codec_embedding.weight[speakers] *= 8
    tiny = omni_tiny(family, model.thinker, tokenizer, *qwen3_omni.build_processor_parts())
    tiny.full_model = model
    return tiny


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)  # the thinker's config, for hub_config
    thinker_config = json.loads((directory / "config.json").read_text())
    tiny.tokenizer.save_pretrained(directory)
    video = {**tiny.image_processor.to_dict(), "video_processor_type": "Qwen2VLVideoProcessor"}
    save_processor_files(tiny, directory, layout, "Qwen3OmniMoeProcessor",
                         qwen3_omni.CHAT_TEMPLATE, qwen3_omni.MIN_PIXELS,
                         qwen3_omni.MAX_PIXELS, video_processor=video)
    state = {name: value.detach().cpu().numpy()
             for name, value in tiny.full_model.state_dict().items()}
    thinker = {name.removeprefix("thinker."): value for name, value in state.items()
               if name.startswith("thinker.")}
    weights = qwen3_omni.hub_weights(thinker)
    for name, value in state.items():
        if not name.startswith("thinker."):
            weights.update(_hub_expert_tensors(name, value))
    config = qwen3_omni.hub_config(thinker_config)
    full = tiny.full_model.config.to_dict()
    config.update(talker_config=_hub_rope(full["talker_config"]),
                  code2wav_config=_legacy_rope(full["code2wav_config"]),
                  enable_audio_output=True)
    for key in ("im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id",
                "tts_eos_token_id", "system_token_id", "user_token_id", "assistant_token_id"):
        config[key] = full[key]
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(weights, directory)
    return directory


def _hub_expert_tensors(name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """A talker layer's 3-D expert tensors -> the Hub's one tensor per expert."""
    layer, _, kind = name.rpartition(".mlp.experts.")
    if not layer:
        return {name: value}
    out = {}
    for expert, matrix in enumerate(value):  # (experts, out, in)
        target = f"{layer}.mlp.experts.{expert}"
        if kind == "gate_up_proj":
            gate, up = np.split(matrix, 2, axis=0)
            out[f"{target}.gate_proj.weight"] = np.ascontiguousarray(gate)
            out[f"{target}.up_proj.weight"] = np.ascontiguousarray(up)
        else:
            out[f"{target}.down_proj.weight"] = np.ascontiguousarray(matrix)
    return out


def _legacy_rope(config: dict) -> dict:
    """transformers 5's ``rope_parameters`` -> the Hub's ``rope_theta`` (+ ``rope_scaling``)."""
    config = {k: v for k, v in config.items() if k not in ("dtype", "transformers_version")}
    rope = dict(config.pop("rope_parameters", None) or {})
    config["rope_theta"] = rope.pop("rope_theta")
    if "mrope_section" in rope:
        config["rope_scaling"] = {**rope, "mrope_interleaved": True}
    return config


def _hub_rope(talker: dict) -> dict:
    talker = {k: v for k, v in talker.items() if k not in ("dtype", "transformers_version")}
    talker["text_config"] = text = _legacy_rope(talker["text_config"])
    text["num_experts"] = text.pop("num_local_experts", text.get("num_experts"))
    talker["code_predictor_config"] = _legacy_rope(talker["code_predictor_config"])
    return talker
