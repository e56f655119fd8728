"""Qwen2.5-Omni speaks: the talker and token2wav (DiT + BigVGAN) against transformers'
Qwen2_5OmniForConditionalGeneration (enable_audio_output=True) on a tiny random full
checkpoint in the Hub's layout (tests/tiny/qwen2_5_omni_speech.py), float32.

- Greedy speech through ``generate``: the thinker's tokens, every talker code and the
  waveform equal transformers' (talker_do_sample=False, its repetition penalty off,
  token2wav started from the same noise), for a text prompt with a system turn and for
  an image (TMRoPE positions, media embeddings left out of the talker's rows).
- token2wav within tolerance of transformers' for the same codes and noise; the DiT's
  mel and BigVGAN's waveform each on their own.
- Voices read from spk_dict.pt without torch (a restricted unpickler that refuses other
  classes), matched exactly as transformers matches them; an unknown one named.
- The generate command writes the same speech as a WAV file; ``convert -q`` quantizes the
  talker and keeps token2wav float.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import wave
import zipfile

import mlx.core as mx
import numpy as np
import pytest

from omni_parity import media_turn, reference_batch
from tiny import make_image, qwen2_5_omni_speech

import mlxvlm
from mlxvlm.errors import MlxvlmError
from mlxvlm.speech.spk_dict import SpeakerFileError, read_spk_dict
from mlxvlm.speech.wav import pcm16

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

THINKER_TOKENS = 8
FRAMES = 10
WAVE_ATOL = 1e-4
MEL_ATOL = 1e-4

CASES = {
    "system_text": ([{"role": "system", "content": "You are a helpful voice."},
                     {"role": "user", "content": "Describe a red circle."}], {}),
    "image": (media_turn("image", text="What do you see?"), {"image": [make_image(112, 84, seed=1)]}),
}


@pytest.fixture(scope="module")
def tiny():
    return qwen2_5_omni_speech.build_tiny_model("qwen2_5_omni_speech", seed=2)


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    return qwen2_5_omni_speech.save_checkpoint(
        tiny, tmp_path_factory.mktemp("qwen2_5-omni-speech"), "hub")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return mlxvlm.load(str(checkpoint))


def our_noise(frames: int) -> torch.Tensor:
    """The noise our token2wav starts from by default (seed 0), for transformers'."""
    shape = (1, frames * 2, qwen2_5_omni_speech.MEL_DIM)
    return torch.from_numpy(np.array(mx.random.normal(shape, key=mx.random.key(0))))


def greedy_talker(talker, input_ids, inputs_embeds, attention_mask, thinker_reply_part,
                  input_text_ids, suppress_tokens, eos_token_id, max_new_tokens, **kwargs):
    """transformers' talker decoding greedily, its forward called step by step with the
    attention mask. (Its ``generate`` drops an all-ones mask before the first forward,
    and without one the talker's forward leaves out the codec pad/bos embeddings and the
    TMRoPE positions that ``Qwen2_5OmniForConditionalGeneration.generate`` prepares:
    with a padded batch it keeps them. Ours follows the model's design, as here.)"""
    from transformers import DynamicCache

    media = {k: kwargs.get(k) for k in ("image_grid_thw", "video_grid_thw", "use_audio_in_video",
                                        "audio_feature_lengths", "video_second_per_grid")}
    talker.rope_deltas = None
    out = talker(input_ids=input_ids, inputs_embeds=inputs_embeds.clone(),
                 attention_mask=attention_mask, thinker_reply_part=thinker_reply_part,
                 input_text_ids=input_text_ids, cache=DynamicCache(config=talker.config),
                 use_cache=True, **media)
    codes = []
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].clone()
        logits[:, suppress_tokens] = -float("inf")
        code = int(logits.argmax(-1))
        codes.append(code)
        if code in eos_token_id:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((1, 1))], dim=1)
        out = talker(input_ids=torch.tensor([[code]]), attention_mask=attention_mask,
                     thinker_reply_part=out.thinker_reply_part, cache=out.cache, use_cache=True)
    return torch.cat([input_ids, torch.tensor([codes])], dim=1)


def transformers_speech(tiny, messages, media, speaker="Chelsie"):
    """transformers' thinker tokens, talker codes and waveform, greedy throughout (its
    talker repetition penalty off), token2wav started from our default noise."""
    full = tiny.full_model
    processor = qwen2_5_omni_speech.reference_processor(tiny)
    batch, extra = reference_batch(processor, messages, media)
    captured = {}
    forward = full.token2wav.forward
    randn = torch.randn

    def capture(code, **kwargs):
        captured["codes"] = code[0].clone()
        return forward(code, **kwargs)

    def noise(*shape, **kwargs):
        size = tuple(shape[0]) if len(shape) == 1 else shape
        return our_noise(size[1] // 2) if len(size) == 3 else randn(*shape, **kwargs)

    full.token2wav.forward = capture
    full.talker.generate = lambda **kwargs: greedy_talker(full.talker, **{
        k: v for k, v in kwargs.items() if k not in ("do_sample", "top_k", "top_p", "temperature",
                                                      "pad_token_id", "repetition_penalty")})
    torch.randn = noise
    config = tiny.full_model.config.talker_config
    try:
        with torch.no_grad():
            sequences, wav = full.generate(
                **batch, **extra, speaker=speaker, thinker_max_new_tokens=THINKER_TOKENS,
                thinker_eos_token_id=tiny.tokenizer.convert_tokens_to_ids("<|im_end|>"),
                thinker_do_sample=False, talker_do_sample=False,
                talker_repetition_penalty=1.0, talker_max_new_tokens=FRAMES,
                talker_eos_token_id=[config.tts_codec_pad_token_id,
                                     config.tts_codec_end_token_id])
    finally:
        full.token2wav.forward = forward
        del full.talker.generate
        torch.randn = randn
    tokens = sequences[0, batch["input_ids"].shape[1]:].tolist()
    return tokens, captured["codes"].numpy(), wav.numpy()


def our_speech(loaded, messages, media, **options):
    model, processor = loaded
    return mlxvlm.generate(model, processor, messages, image=media.get("image"),
                           max_tokens=THINKER_TOKENS, audio_output=True, talker_temperature=0,
                           talker_max_frames=FRAMES, **options)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_speech_matches_transformers(tiny, loaded, case):
    messages, media = CASES[case]
    tokens, codes, wav = transformers_speech(tiny, messages, media)
    out = our_speech(loaded, messages, media)
    assert out.tokens == tokens
    assert len(codes) > 2
    np.testing.assert_array_equal(out.audio_codes, codes)
    assert out.sample_rate == 24000 and out.audio.dtype == np.float32
    assert out.audio.shape == wav.shape == (len(codes) * qwen2_5_omni_speech.SAMPLES_PER_CODE,)
    assert wav.std() > 1e-3 and (np.abs(wav) < 1).mean() > 0.9  # a waveform, not clipped flat
    np.testing.assert_allclose(out.audio, wav, rtol=0, atol=WAVE_ATOL)
    assert out.voice == "Chelsie"
