"""A tiny full Qwen2.5-Omni (thinker, talker and token2wav), built offline, for the
speech parity tests against transformers.

``Qwen2_5OmniForConditionalGeneration`` with ``enable_audio_output=True`` and random
float32 weights. The thinker is tests/tiny/omni.py's (2 layers, 64 wide), its tokenizer
with the talker's text tokens (``tts_text_*``) and two voices' start tokens added. The
talker is a 2-layer Qwen2 M-RoPE decoder 32 wide over an 80-entry codec vocabulary: 72
codes, then codec pad, bos, end and mask (at the Hub's offsets from one another); like
the 7B's (12 heads of 128 over 4 KV heads in 896-wide layers) its heads are wider
together than its layers (3 of 16 over 1 KV head: 48 against 32). The
DiT: 2 blocks (the second looking one block ahead, the first one back) over 4-frame
blocks, an ECAPA speaker encoder of 16 channels over an 8-bin mel; BigVGAN upsamples 3x
then 2x: 12 samples per code.

One layout, ``"hub"``: the layout of Qwen/Qwen2.5-Omni-7B: the full config
(``model_type: qwen2_5_omni`` with ``thinker_config``, ``talker_config`` and
``token2wav_config``; the talker's rope as ``rope_scaling`` and ``rope_theta``), tensors
``thinker.*`` as tests/tiny/omni.py writes them, ``talker.*`` and ``token2wav.*`` as
transformers names them, and the voices in ``spk_dict.pt`` (a torch pickle, as the Hub
ships them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny import omni
from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors

FAMILIES = ("qwen2_5_omni_speech",)
LAYOUTS = ("hub",)

TTS_TOKENS = ("<|tts_text_pad|>", "<|tts_text_bos|>", "<|tts_text_eos|>", "<|voice_chelsie|>",
              "<|voice_ethan|>")
VOICES = {"Chelsie": "<|voice_chelsie|>", "Ethan": "<|voice_ethan|>"}
TALKER_VOCAB = 80
CODEC_IDS = dict(tts_codec_pad_token_id=72, tts_codec_start_token_id=73,
                 tts_codec_end_token_id=74, tts_codec_mask_token_id=76)
MEL_DIM = 8
REFERENCE_FRAMES = 20
SAMPLES_PER_CODE = 2 * 3 * 2
TALKER_ROPE_THETA = 20000.0
DIT_ROPE_THETA = 5000.0


def build_tokenizer():
    return build_bpe_tokenizer(
        omni.SPECIAL_TOKENS + TTS_TOKENS, chat_template=omni.CHAT_TEMPLATE,
        eos_token="<|im_end|>", pad_token="<|endoftext|>", extra_special_tokens=omni.OMNI_TOKENS,
    )


def _config(tokenizer):
    from transformers import Qwen2_5OmniConfig

    thinker = omni._config(tokenizer).to_dict()
    ids = tokenizer.convert_tokens_to_ids
    talker = dict(
        vocab_size=TALKER_VOCAB, embedding_size=thinker["text_config"]["hidden_size"],
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": TALKER_ROPE_THETA,
                         "mrope_section": [2, 3, 3]},
        tts_text_start_token_id=ids("<|tts_text_bos|>"),
        tts_text_end_token_id=ids("<|tts_text_eos|>"),
        tts_text_pad_token_id=ids("<|tts_text_pad|>"), **CODEC_IDS,
        audio_token_index=thinker["audio_token_index"],
        image_token_index=thinker["image_token_index"],
        video_token_index=thinker["video_token_index"],
        vision_start_token_id=thinker["vision_start_token_id"],
        vision_end_token_id=thinker["vision_end_token_id"],
        audio_start_token_id=thinker["audio_start_token_id"],
        audio_end_token_id=thinker["audio_end_token_id"],
        position_id_per_seconds=25, seconds_per_chunk=2, spatial_merge_size=2,
        initializer_range=INIT_RANGE,
    )
    dit = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, ff_mult=2,
        emb_dim=16, block_size=4, look_ahead_layers=[1], look_backward_layers=[0], repeats=2,
        num_embeds=TALKER_VOCAB - 1, mel_dim=MEL_DIM, enc_emb_dim=8, enc_dim=8,
        enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
        enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=2,
        enc_se_channels=8, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": DIT_ROPE_THETA},
    )
    bigvgan = dict(mel_dim=MEL_DIM, upsample_initial_channel=32, resblock_kernel_sizes=[3, 5],
                   resblock_dilation_sizes=[[1, 3, 5], [1, 2, 3]], upsample_rates=[3, 2],
                   upsample_kernel_sizes=[7, 4])
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan},
                             enable_audio_output=True)


def voices(tokenizer, generator) -> dict:
    """spk_dict.pt's content: each voice's conditioning, reference mel and start token."""
    import torch

    return {name: {"cond": torch.randn(1, 8, generator=generator),
                   "ref_mel": torch.randn(1, REFERENCE_FRAMES, MEL_DIM, generator=generator) - 4,
                   "bos_token": tokenizer.convert_tokens_to_ids(token)}
            for name, token in VOICES.items()}


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(_config(tokenizer)).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    perturb_constants(model, generator)
    with torch.no_grad():
        # token2wav off its init: the adaptive norms' gates (zero-ish) and the snake
        # scales (zero) to where they matter, every weight large enough to be heard
        for name, param in model.token2wav.named_parameters():
            if name.endswith((".alpha", ".beta")):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
        # the voices' start tokens loud enough that each voice speaks other codes
        for token in VOICES.values():
            model.thinker.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids(token)] *= 20
    model.speaker_map = voices(tokenizer, generator)
    tiny = omni.omni_tiny(family, model.thinker, tokenizer, *omni.build_processor_parts())
    tiny.full_model = model
    return tiny


def reference_processor(tiny: TinyModel):
    return omni.reference_processor(tiny)


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    import torch

    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    directory = Path(directory)
    omni.save_checkpoint(tiny, directory, "hub")  # the thinker, processor and tokenizer
    config = json.loads((directory / "config.json").read_text())
    full = tiny.full_model.config.to_dict()
    talker = {k: v for k, v in full["talker_config"].items()
              if k not in ("dtype", "transformers_version")}
    rope = dict(talker.pop("rope_parameters"))
    talker["rope_theta"] = rope.pop("rope_theta")
    talker["rope_scaling"] = {**rope, "type": "mrope"}
    config.update(talker_config=talker, token2wav_config=full["token2wav_config"],
                  enable_audio_output=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    state = {name: value.detach().cpu().numpy()
             for name, value in tiny.full_model.state_dict().items()}
    weights = {omni._hub_name(name[len("thinker."):]): value for name, value in state.items()
               if name.startswith("thinker.")}
    weights.update({name: value for name, value in state.items()
                    if name.startswith(("talker.", "token2wav."))})
    write_safetensors(weights, directory)
    torch.save(tiny.full_model.speaker_map, directory / "spk_dict.pt")
    return directory
