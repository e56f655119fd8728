"""Qwen3-Omni speaks: the talker, its code predictor and code2wav against transformers'
Qwen3OmniMoeForConditionalGeneration (enable_audio_output=True) on a tiny random full
checkpoint in the Hub's layout (tests/tiny/qwen3_omni_speech.py), float32.

- Every codec frame (the talker's first code and the code predictor's other groups) of
  greedy speech equals transformers' (talker_do_sample=False and its repetition penalty
  off), for a text prompt with a system turn, a conversation whose earlier assistant
  turn the talker leaves out, and an image (the thinker's hidden states through
  ``hidden_projection``, M-RoPE positions); the waveform within 1e-4 of the one
  transformers decodes from those codes.
- code2wav within 1e-4 of transformers' for the same codes (a sequence crossing its
  attention window), and decoded chunk by chunk with its own left context, concatenated
  within 1e-5 of the one-shot waveform.
- Voices by name in any case; an unknown voice is a one-line error naming them; a
  thinker-only checkpoint (and a full config over tensors without the speech parts)
  loads the thinker alone and refuses audio output.
- The generate command writes the same speech as a 16-bit WAV file.
- The talker follows the thinker (``stream_generate(..., audio_output=True)``): it starts
  once the answer's first token is fed (its prefill needs it) and takes one row per token
  after, so the first audio chunk comes while the text is still being written; its codes
  and waveform equal a talker started after the whole answer (``speech.pipeline.speak``
  over the same recorded states), and the streamed chunks concatenate exactly to that
  waveform. A seed makes the sampled talker's codes reproducible, interleaved or not;
  closing the stream mid-answer frees the talker and the tap.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import wave

from functools import partial

import mlx.core as mx
import numpy as np
import pytest

import speech_following
from omni_parity import media_turn, reference_batch
from tiny import make_image
from tiny import qwen3_omni, qwen3_omni_speech

import mlxvlm
from mlxvlm.errors import MlxvlmError
from mlxvlm.speech import pipeline
from mlxvlm.speech.codec import FIRST_CHUNK_FRAMES
from mlxvlm.models.layers.qwen3_omni_code2wav import Code2WavStream
from mlxvlm.speech.codec import CodecStream
from mlxvlm.speech.wav import pcm16

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

THINKER_TOKENS = 8
FRAMES = 12  # past the code2wav's 8-frame attention window
WAVE_ATOL = 1e-4
CHUNK_ATOL = 1e-5

CASES = {
    "system_text": ([{"role": "system", "content": "You are a helpful voice."},
                     {"role": "user", "content": "Describe a red circle."}], {}),
    "conversation": ([{"role": "user", "content": "Hello there."},
                      {"role": "assistant", "content": "Hi! What shall we talk about?"},
                      {"role": "user", "content": "Tell me about squares."}], {}),
    # transformers' talker cannot place audio (its get_rope_index reads an audio_config
    # the talker config lacks), so the media case is an image
    "image": (media_turn("image", text="What do you see?"), {"image": [make_image(112, 84, seed=1)]}),
}


@pytest.fixture(scope="module")
def tiny():
    return qwen3_omni_speech.build_tiny_model("qwen3_omni_moe_speech", seed=2)


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    return qwen3_omni_speech.save_checkpoint(
        tiny, tmp_path_factory.mktemp("qwen3-omni-speech"), "hub")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return mlxvlm.load(str(checkpoint))


def transformers_speech(tiny, messages, media, speaker="Ethan"):
    """transformers' thinker tokens, talker codes (frames, groups) and waveform, greedy
    throughout (its talker repetition penalty off)."""
    full = tiny.full_model
    processor = qwen3_omni.reference_processor(tiny)
    batch, extra = reference_batch(processor, messages, media)
    captured = {}
    decode = full.code2wav.chunked_decode

    def capture(codes, **kwargs):
        captured["codes"] = codes.clone()
        return decode(codes, **kwargs)

    full.code2wav.chunked_decode = capture
    try:
        with torch.no_grad():
            sequences, wav = full.generate(
                **batch, **extra, speaker=speaker, thinker_max_new_tokens=THINKER_TOKENS,
                thinker_eos_token_id=tiny.tokenizer.convert_tokens_to_ids("<|im_end|>"),
                thinker_do_sample=False, talker_do_sample=False,
                talker_repetition_penalty=1.0, talker_max_new_tokens=FRAMES + 1)
    finally:
        full.code2wav.chunked_decode = decode
    tokens = sequences[0, batch["input_ids"].shape[1]:].tolist()
    return tokens, captured["codes"][0].T.numpy(), wav[0, 0].numpy()


def our_speech(loaded, messages, media, **options):
    model, processor = loaded
    return mlxvlm.generate(model, processor, messages, image=media.get("image"),
                           audio=media.get("audio"), max_tokens=THINKER_TOKENS,
                           audio_output=True, talker_temperature=0, talker_max_frames=FRAMES,
                           **options)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_speech_matches_transformers(tiny, loaded, case):
    messages, media = CASES[case]
    tokens, codes, wav = transformers_speech(tiny, messages, media)
    out = our_speech(loaded, messages, media)
    assert out.tokens == tokens
    assert codes.shape == (FRAMES, qwen3_omni_speech.CODE_GROUPS)
    # the talker's first codes and the code predictor's other groups, frame by frame
    np.testing.assert_array_equal(out.audio_codes, codes)
    assert out.sample_rate == 24000 and out.audio.dtype == np.float32
    assert out.audio.shape == wav.shape
    np.testing.assert_allclose(out.audio, wav, rtol=0, atol=WAVE_ATOL)
    assert out.voice == "Ethan"


def test_the_voice_and_the_prompt_change_the_codes(tiny, loaded):
    """The speaker id and the thinker's states reach the talker: another voice, or
    another prompt, speaks other codes (so the equalities above can fail)."""
    messages, media = CASES["system_text"]
    ethan = our_speech(loaded, messages, media).audio_codes
    chelsie = our_speech(loaded, messages, media, voice="chelsie").audio_codes
    _, reference, _ = transformers_speech(tiny, messages, media, speaker="Chelsie")
    np.testing.assert_array_equal(chelsie, reference)
    assert not np.array_equal(ethan, chelsie)
    other = our_speech(loaded, *CASES["conversation"]).audio_codes
    assert not np.array_equal(ethan, other)


def test_voices_are_matched_in_any_case_and_unknown_ones_named(loaded):
    messages, media = CASES["system_text"]
    upper = our_speech(loaded, messages, media, voice="AIDEN")
    assert upper.voice == "Aiden"
    np.testing.assert_array_equal(upper.audio_codes,
                                  our_speech(loaded, messages, media, voice="aiden").audio_codes)
    with pytest.raises(MlxvlmError, match=r"unknown voice 'Bob': this model's voices are "
                                          r"Aiden, Chelsie, Ethan$"):
        our_speech(loaded, messages, media, voice="Bob")
    model, processor = loaded
    with pytest.raises(MlxvlmError, match="need audio_output=True"):
        mlxvlm.generate(model, processor, "Hi", max_tokens=2, voice="ethan")


def test_sampled_speech_draws_only_codes(loaded):
    """The checkpoint's own sampling (temperature 0.9, top-k 50, the repetition penalty)
    draws codec codes only: the special entries stay suppressed, groups stay in their
    codebooks, the codec decodes them."""
    model, processor = loaded
    mx.random.seed(0)
    out = mlxvlm.generate(model, processor, "Describe a red circle.", max_tokens=4,
                          audio_output=True, talker_max_frames=FRAMES)
    codes = out.audio_codes
    assert codes.shape[1] == qwen3_omni_speech.CODE_GROUPS and 0 < len(codes) <= FRAMES
    assert codes.min() >= 0 and codes.max() < qwen3_omni_speech.CODEBOOK
    assert len(out.audio) == len(codes) * 24 - 8


# ---------------------------------------------------------------- following the thinker


spoken_after_the_answer = partial(speech_following.spoken_after_the_answer,
                                  max_tokens=THINKER_TOKENS, frames=FRAMES)
streamed = partial(speech_following.streamed, max_tokens=THINKER_TOKENS, frames=FRAMES)


def test_the_talker_follows_the_thinker_and_speaks_as_if_started_after_it(loaded):
    model, _ = loaded
    messages = CASES["system_text"][0]
    results = streamed(loaded, messages, talker_temperature=0)
    text, one_shot = spoken_after_the_answer(loaded, messages, talker_temperature=0)
    texts = [r for r in results if r.token is not None]
    chunks = [r.audio for r in results if r.token is None]
    assert [r.token for r in texts] == text.tokens and len(texts) == THINKER_TOKENS
    assert texts[-1].finish_reason is not None
    speech = results[-1].speech
    np.testing.assert_array_equal(speech.codes, one_shot.codes)
    assert speech.codes.shape == (FRAMES, qwen3_omni_speech.CODE_GROUPS)
    np.testing.assert_array_equal(np.concatenate(chunks), one_shot.audio)
    np.testing.assert_array_equal(speech.audio, one_shot.audio)
    whole = np.asarray(model.code2wav(mx.array(speech.codes[None]))[0])
    np.testing.assert_allclose(np.concatenate(chunks), whole, rtol=0, atol=CHUNK_ATOL)
    assert all(r.sample_rate == 24000 and r.audio.dtype == np.float32
               for r in results if r.token is None)
    # The prefill takes the answer's first token; each token fed after it is one more row,
    # one more frame: the first chunk is spoken after at most FIRST_CHUNK_FRAMES + 1
    # tokens, while the rest of the answer is still to come.
    first_audio = next(i for i, r in enumerate(results) if r.token is None)
    last_text = max(i for i, r in enumerate(results) if r.token is not None)
    assert first_audio <= FIRST_CHUNK_FRAMES + 1 and first_audio < last_text
    assert len(chunks[0]) == FIRST_CHUNK_FRAMES * 24 - 8


def test_a_talker_ending_before_the_text_leaves_the_text_whole(loaded):
    model, processor = loaded
    messages = CASES["system_text"][0]
    results = list(mlxvlm.stream_generate(model, processor, messages, max_tokens=THINKER_TOKENS,
                                          audio_output=True, talker_temperature=0,
                                          talker_max_frames=2))
    text = mlxvlm.generate(model, processor, messages, max_tokens=THINKER_TOKENS)
    assert [r.token for r in results if r.token is not None] == text.tokens
    speech = results[-1].speech
    assert speech.codes.shape == (2, qwen3_omni_speech.CODE_GROUPS)
    assert len(speech.audio) == 2 * 24 - 8


def test_a_seed_makes_the_sampled_talker_reproducible_interleaved_or_not(loaded):
    messages = CASES["conversation"][0]
    sampled = dict(temperature=0.8, seed=7)  # the thinker samples between the talker's steps
    mx.random.seed(1)
    first = streamed(loaded, messages, **sampled)[-1].speech
    mx.random.seed(2)
    again = streamed(loaded, messages, **sampled)[-1].speech
    np.testing.assert_array_equal(first.codes, again.codes)
    np.testing.assert_array_equal(first.audio, again.audio)
    _, one_shot = spoken_after_the_answer(loaded, messages, **sampled)
    np.testing.assert_array_equal(first.codes, one_shot.codes)
    other = streamed(loaded, messages, temperature=0.8, seed=8)[-1].speech
    assert not np.array_equal(first.codes, other.codes)


def test_closing_the_stream_mid_answer_frees_the_talker_and_the_tap(loaded, monkeypatch):
    model, processor = loaded
    closed = []
    close = pipeline.AnswerSpeaker.close

    def spy(self):
        closed.append(self.talker)
        close(self)

    monkeypatch.setattr(pipeline.AnswerSpeaker, "close", spy)
    messages = CASES["system_text"][0]
    stream = mlxvlm.stream_generate(model, processor, messages, max_tokens=THINKER_TOKENS,
                                    audio_output=True, talker_temperature=0,
                                    talker_max_frames=4096)
    seen = []
    for result in stream:
        seen.append(result.token)
        if result.token is None:
            break  # the first chunk, mid-answer
    stream.close()
    assert None in seen and len(seen) < THINKER_TOKENS + 1
    assert closed and closed[0].finished and closed[0].cache == []
    assert model.language_model.model.hidden_tap is None
    again = streamed(loaded, messages, talker_temperature=0)[-1].speech
    _, one_shot = spoken_after_the_answer(loaded, messages, talker_temperature=0)
    np.testing.assert_array_equal(again.codes, one_shot.codes)


# ------------------------------------------------------------------------------ code2wav


def random_codes(frames: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, qwen3_omni_speech.CODEBOOK, size=(frames, qwen3_omni_speech.CODE_GROUPS))


def test_code2wav_matches_transformers(tiny, loaded):
    model, _ = loaded
    codes = random_codes(40, seed=3)
    with torch.no_grad():
        reference = tiny.full_model.code2wav(torch.tensor(codes.T[None]))[0, 0].numpy()
    ours = np.asarray(model.code2wav(mx.array(codes[None]))[0])
    assert ours.shape == reference.shape == (40 * 24 - 8,)
    # a waveform, not a constant or a clipped square wave
    assert reference.std() > 1e-3 and (np.abs(reference) < 1).all()
    np.testing.assert_allclose(ours, reference, rtol=0, atol=WAVE_ATOL)


@pytest.mark.parametrize("chunks", [[1] * 30, [4, 24, 2], [7, 9, 14], [29, 1]])
def test_chunked_decoding_concatenates_to_the_one_shot_waveform(loaded, chunks):
    model, _ = loaded
    codes = random_codes(sum(chunks), seed=4)
    one_shot = np.asarray(model.code2wav(mx.array(codes[None]))[0])
    stream = Code2WavStream()
    pieces, start = [], 0
    for size in chunks:
        pieces.append(np.asarray(model.code2wav(mx.array(codes[None, start:start + size]), stream)[0]))
        start += size
    joined = np.concatenate(pieces)
    assert joined.shape == one_shot.shape
    np.testing.assert_allclose(joined, one_shot, rtol=0, atol=CHUNK_ATOL)


def test_the_codec_stream_decodes_a_small_first_chunk_then_larger_ones(loaded):
    model, _ = loaded
    codes = random_codes(30, seed=5)
    codec = CodecStream(model.code2wav, first_chunk_frames=2, chunk_frames=8)
    chunks = [chunk for frame in codes if (chunk := codec.push(frame)) is not None]
    chunks.append(codec.flush())
    assert [len(c) for c in chunks] == [2 * 24 - 8, 8 * 24, 8 * 24, 8 * 24, 4 * 24]
    one_shot = np.asarray(model.code2wav(mx.array(codes[None]))[0])
    np.testing.assert_allclose(np.concatenate(chunks), one_shot, rtol=0, atol=CHUNK_ATOL)


def test_dropping_the_streams_context_breaks_the_seams(loaded):
    """Chunks decoded without their left context do not join up: the test above checks
    what the stream keeps."""
    model, _ = loaded
    codes = random_codes(20, seed=6)
    one_shot = np.asarray(model.code2wav(mx.array(codes[None]))[0])
    pieces = [np.asarray(model.code2wav(mx.array(codes[None, a:b]))[0]) for a, b in ((0, 10), (10, 20))]
    joined = np.concatenate(pieces)
    assert joined.shape != one_shot.shape or np.abs(joined - one_shot).max() > 1e-3


# ------------------------------------------------------------------ checkpoints without speech


def test_a_thinker_only_checkpoint_loads_as_before_and_does_not_speak(tiny_checkpoints):
    model, processor = mlxvlm.load(str(tiny_checkpoints.path("qwen3_omni_moe", "hub")))
    assert not model.speaks and "talker" not in model
    with pytest.raises(MlxvlmError, match="this model does not speak"):
        mlxvlm.generate(model, processor, "Hi", max_tokens=2, audio_output=True)


def test_a_full_config_over_thinker_tensors_loads_the_thinker_alone(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    copy = tmp_path / "thinker-tensors"
    shutil.copytree(checkpoint, copy)
    weights = load_file(str(copy / "model.safetensors"))
    thinker = {k: v for k, v in weights.items() if k.startswith("thinker.")}
    assert len(thinker) < len(weights)
    save_file(thinker, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert "talker_config" in json.loads((copy / "config.json").read_text())
    model, _ = mlxvlm.load(str(copy))
    assert not model.speaks


def test_a_quantized_conversion_quantizes_the_talker_and_keeps_the_codec_float(checkpoint,
                                                                               tmp_path):
    from mlxvlm.convert import convert

    convert(str(checkpoint), tmp_path / "q4", quantize=True, q_bits=4, q_group_size=32,
            quantize_vision=True)
    model, processor = mlxvlm.load(str(tmp_path / "q4"))
    assert model.speaks
    quantized = {path for path, module in model.named_modules() if "scales" in module}
    assert "talker.model.layers.0.self_attn.q_proj" in quantized
    assert "talker.code_predictor.lm_head.0" in quantized
    assert not [path for path in quantized if path.startswith("code2wav")]
    out = mlxvlm.generate(model, processor, "Describe a red circle.", max_tokens=4,
                          audio_output=True, talker_temperature=0, talker_max_frames=6)
    assert out.audio_codes.shape == (6, qwen3_omni_speech.CODE_GROUPS)
    assert out.audio.shape == (6 * 24 - 8,)


# ------------------------------------------------------------------------------ the CLI


def test_the_generate_command_writes_the_speech_as_a_wav(loaded, checkpoint, tmp_path):
    out = tmp_path / "answer.wav"
    command = [sys.executable, "-m", "mlxvlm.generate", "--model", str(checkpoint),
               "--prompt", "Describe a red circle.", "--max-tokens", str(THINKER_TOKENS),
               "--audio-output", str(out), "--voice", "CHELSIE", "--talker-temperature", "0.7",
               "--seed", "7", "--talker-max-frames", str(FRAMES), "--verbose"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "time to first audio:" in run.stderr and "real-time factor:" in run.stderr
    # the sampled talker's codes from the seed, in another process as here
    model, processor = loaded
    expected = mlxvlm.generate(model, processor, "Describe a red circle.",
                               max_tokens=THINKER_TOKENS, audio_output=True, voice="Chelsie",
                               talker_temperature=0.7, seed=7, talker_max_frames=FRAMES)
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert wav.readframes(wav.getnframes()) == pcm16(expected.audio)



def test_the_generate_command_refuses_an_unknown_voice_in_one_line(checkpoint, tmp_path, capsys):
    from mlxvlm.generate.__main__ import main

    code = main(["--model", str(checkpoint), "--prompt", "Hi", "--max-tokens", "2",
                 "--audio-output", str(tmp_path / "x.wav"), "--voice", "nobody"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: unknown voice 'nobody': this model's voices are Aiden, Chelsie, Ethan")
    assert not (tmp_path / "x.wav").exists()
    assert main(["--model", str(checkpoint), "--prompt", "Hi", "--voice", "ethan"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --voice, --talker-temperature and --talker-max-frames need --audio-output")
