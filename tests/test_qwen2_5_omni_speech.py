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
- The generate command (its ``main``) writes the same speech as a WAV file, and refuses
  an unknown voice in one line; ``convert -q`` quantizes the talker and keeps token2wav
  float; a thinker-only checkpoint loads as before and does not speak.
- Two spoken requests decoding in one batching-engine batch beside a text one speak as
  ``generate`` does (each talker reads its own row of the batched hidden states).
- The talker follows the thinker (``stream_generate(..., audio_output=True)``): it starts
  once the answer's first token is fed and hears one row per token after, so its frames
  come while the text is written; its codes and waveform equal a talker started after
  the whole answer (``speech.pipeline.speak`` over the same recorded states). A seed
  makes the sampled talker's codes reproducible, interleaved with the thinker's sampling
  or not.
- ``python -m mlxvlm.server`` answers a chat completion's audio (whole and streamed) and
  /v1/audio/speech with the Python API's speech.

transformers' side runs on one torch thread: its DiT's many small passes are ~100x
slower on two threads of a busy machine.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import wave
import zipfile

from functools import partial

import mlx.core as mx
import numpy as np
import pytest

import speech_following
from omni_parity import media_turn, reference_batch
from tiny import make_image, qwen2_5_omni_speech

import mlxvlm
from mlxvlm.errors import MlxvlmError
from mlxvlm.speech import pipeline
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


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers' DiT runs its 36 small passes ~100x slower on two threads of a busy
    machine than on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def test_the_voice_reaches_the_talker_and_is_matched_exactly(tiny, loaded):
    """Ethan's codes are transformers' for Ethan and not Chelsie's (so the equalities
    above can fail); names match exactly, as transformers matches them."""
    messages, media = CASES["system_text"]
    ethan = our_speech(loaded, messages, media, voice="Ethan")
    _, reference, _ = transformers_speech(tiny, messages, media, speaker="Ethan")
    np.testing.assert_array_equal(ethan.audio_codes, reference)
    assert ethan.voice == "Ethan"
    assert not np.array_equal(ethan.audio_codes, our_speech(loaded, messages, media).audio_codes)
    with pytest.raises(MlxvlmError, match=r"^unknown voice 'ethan': this model's voices are "
                                          r"Chelsie, Ethan$"):
        our_speech(loaded, messages, media, voice="ethan")


def test_sampled_speech_draws_codes_and_never_the_codec_bos(loaded):
    """The checkpoint's own sampling (temperature 0.9, top-k 40, top-p 0.8, the
    repetition penalty) draws codes token2wav decodes, never codec_bos."""
    model, processor = loaded
    mx.random.seed(0)
    out = mlxvlm.generate(model, processor, "Describe a red circle.", max_tokens=4,
                          audio_output=True, talker_max_frames=FRAMES)
    codes = out.audio_codes
    assert codes.ndim == 1 and 0 < len(codes) <= FRAMES
    assert qwen2_5_omni_speech.CODEC_IDS["tts_codec_start_token_id"] not in codes
    assert codes.min() >= 0 and codes.max() < qwen2_5_omni_speech.TALKER_VOCAB
    assert out.audio.shape == (len(codes) * qwen2_5_omni_speech.SAMPLES_PER_CODE,)


# ---------------------------------------------------------------- following the thinker


spoken_after_the_answer = partial(speech_following.spoken_after_the_answer,
                                  max_tokens=THINKER_TOKENS, frames=FRAMES)
streamed = partial(speech_following.streamed, max_tokens=THINKER_TOKENS, frames=FRAMES)


def test_the_talker_follows_the_thinker_and_speaks_as_if_started_after_it(loaded, monkeypatch):
    """The talker's prefill takes the answer's first token; each token fed after it is one
    more row, one more frame: its codes and token2wav's waveform equal those of a talker
    started after the whole answer (whose codes equal transformers', above), and its
    frames come while the text is still being written."""
    events = []
    took = pipeline.AnswerSpeaker.took

    def frame_taken(self, frame):
        events.append("frame")
        return took(self, frame)

    monkeypatch.setattr(pipeline.AnswerSpeaker, "took", frame_taken)
    messages = CASES["system_text"][0]
    results = []
    for result in mlxvlm.stream_generate(loaded[0], loaded[1], messages,
                                         max_tokens=THINKER_TOKENS, audio_output=True,
                                         talker_temperature=0, talker_max_frames=FRAMES):
        results.append(result)
        if result.token is not None:
            events.append("text")
    monkeypatch.undo()
    text, one_shot = spoken_after_the_answer(loaded, messages, talker_temperature=0)
    texts = [r for r in results if r.token is not None]
    assert [r.token for r in texts] == text.tokens and len(texts) == THINKER_TOKENS
    speech = results[-1].speech
    assert speech.codes.shape == (FRAMES,)
    np.testing.assert_array_equal(speech.codes, one_shot.codes)
    chunks = [r.audio for r in results if r.token is None and len(r.audio)]
    np.testing.assert_array_equal(np.concatenate(chunks), one_shot.audio)
    np.testing.assert_array_equal(speech.audio, one_shot.audio)
    # Token k (from 1) written, the rows of tokens 1 .. k-1 are heard: k-1 frames. The
    # answer has no end of sequence within THINKER_TOKENS, so before its last token
    # (whose row is never heard) the talker has spoken THINKER_TOKENS - 2 frames.
    last_text = len(events) - 1 - events[::-1].index("text")
    assert events.index("frame") < last_text
    assert events[:last_text].count("frame") == THINKER_TOKENS - 2
    assert events.count("frame") == FRAMES


def test_a_seed_makes_the_sampled_talker_reproducible_interleaved_or_not(loaded):
    """Seeded, each talker code is drawn from its own seed: the same codes whatever the
    thinker's sampling drew between the talker's steps (interleaved with another global
    random state, or all before them), and other codes for another seed; unseeded, the
    global random state decides."""
    messages = CASES["system_text"][0]
    sampled = dict(temperature=0.8, seed=7)  # the thinker samples between the talker's steps
    mx.random.seed(1)
    first = streamed(loaded, messages, **sampled)
    mx.random.seed(2)
    again = streamed(loaded, messages, **sampled)
    assert [r.token for r in first] == [r.token for r in again]
    np.testing.assert_array_equal(first[-1].speech.codes, again[-1].speech.codes)
    np.testing.assert_array_equal(first[-1].speech.audio, again[-1].speech.audio)
    text, one_shot = spoken_after_the_answer(loaded, messages, **sampled)
    assert text.tokens == [r.token for r in first if r.token is not None]
    np.testing.assert_array_equal(first[-1].speech.codes, one_shot.codes)
    other = streamed(loaded, messages, temperature=0, seed=8)[-1].speech
    seeded = streamed(loaded, messages, temperature=0, seed=7)[-1].speech
    assert not np.array_equal(other.codes, seeded.codes)
    mx.random.seed(1)
    unseeded = streamed(loaded, messages, temperature=0)[-1].speech
    mx.random.seed(2)
    unseeded_again = streamed(loaded, messages, temperature=0)[-1].speech
    assert not np.array_equal(unseeded.codes, unseeded_again.codes)


# ------------------------------------------------------------------------------ token2wav


def test_token2wav_and_its_parts_match_transformers(tiny, loaded):
    """For the same codes (14: a 28-frame mel across seven 4-frame attention blocks) and
    noise: the DiT's mel, BigVGAN's waveform of transformers' mel, and the two together."""
    model, _ = loaded
    full = tiny.full_model.token2wav
    voice = tiny.full_model.speaker_map["Ethan"]
    codes = np.random.default_rng(3).integers(0, 72, size=(1, 14))
    noise = torch.randn(1, 28, qwen2_5_omni_speech.MEL_DIM, generator=torch.Generator().manual_seed(4))
    randn = torch.randn
    torch.randn = lambda *shape, **kwargs: noise.clone()
    try:
        with torch.no_grad():
            mel = full.code2wav_dit_model.sample(voice["cond"], voice["ref_mel"], torch.tensor(codes))
            wav = full.code2wav_bigvgan_model(mel).numpy()
    finally:
        torch.randn = randn
    ours = dict(codes=mx.array(codes), conditioning=mx.array(voice["cond"].numpy()),
                reference_mel=mx.array(voice["ref_mel"].numpy()), noise=mx.array(noise.numpy()))
    our_mel = model.token2wav.code2wav_dit_model.sample(**ours)
    reference_mel = mel[0].T.numpy()
    assert reference_mel.std() > 0.1
    np.testing.assert_allclose(np.array(our_mel[0]), reference_mel, rtol=0, atol=MEL_ATOL)
    vocoded = model.token2wav.code2wav_bigvgan_model(mx.array(mel.transpose(1, 2).numpy()))
    assert wav.shape == (14 * qwen2_5_omni_speech.SAMPLES_PER_CODE,) and wav.std() > 1e-3
    np.testing.assert_allclose(np.array(vocoded[0]), wav, rtol=0, atol=WAVE_ATOL)
    np.testing.assert_allclose(np.array(model.token2wav(**ours)[0]), wav, rtol=0, atol=WAVE_ATOL)


# ------------------------------------------------------------------------------ voices


def test_voices_are_read_without_torch(tiny, checkpoint):
    script = ("import sys, json; sys.modules['torch'] = None\n"
              "from mlxvlm.speech.spk_dict import load_voices\n"
              f"voices = load_voices({str(checkpoint)!r}, {qwen2_5_omni_speech.MEL_DIM})\n"
              "print(json.dumps({n: [v.conditioning.tolist(), v.reference_mel.tolist(), "
              "v.bos_token] for n, v in voices.items()}))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("MLXVLM_ALLOW_TORCH", None)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    import json

    voices = json.loads(run.stdout)
    assert sorted(voices) == ["Chelsie", "Ethan"]
    for name, entry in tiny.full_model.speaker_map.items():
        cond, ref_mel, bos = voices[name]
        np.testing.assert_array_equal(cond, entry["cond"].numpy())
        np.testing.assert_array_equal(ref_mel, entry["ref_mel"].numpy())
        assert bos == entry["bos_token"]


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_voices_file_naming_other_classes_is_refused(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "spk_dict.pt"
    torch.save({"Chelsie": {"cond": torch.zeros(1, 8), "bos_token": _Payload(marker)}}, path)
    with pytest.raises(SpeakerFileError, match=r"refers to posix\.system.*refusing"):
        read_spk_dict(path)
    assert not marker.exists()
    with zipfile.ZipFile(path) as archive:
        assert any(name.endswith("data.pkl") for name in archive.namelist())
    # a plain pickle (not torch's archive) is refused before anything is unpickled
    (tmp_path / "plain.pt").write_bytes(pickle.dumps({"Chelsie": 1}))
    with pytest.raises(SpeakerFileError, match="not a torch zip archive"):
        read_spk_dict(tmp_path / "plain.pt")


def test_spoken_rows_of_the_batching_engine_speak_as_generate_does(loaded):
    """Two spoken requests decoding in one engine batch beside a text one: each talker
    reads its own row of every batched step's last hidden states (``RowsTap``; this
    family's talker reads the whole answer's), so its codes and waveform are generate's."""
    import threading

    from mlxvlm.batching import BatchAudio, BatchEngine, BatchStep, SamplingOptions
    from mlxvlm.generate.speech import SpeechRequest
    from mlxvlm.prompt import prepare_inputs

    model, processor = loaded
    spoken = [CASES["system_text"][0], [{"role": "user", "content": "Describe a blue square."}]]
    counting = [{"role": "user", "content": "Count to many."}]
    engine = BatchEngine(model, processor, max_batch_size=3)
    items, done = [[], [], []], [threading.Event() for _ in range(3)]
    for i, (messages, speech, max_tokens) in enumerate([
            (spoken[0], SpeechRequest(None, 0, FRAMES), THINKER_TOKENS),
            (spoken[1], SpeechRequest("Ethan", 0, FRAMES), THINKER_TOKENS),
            (counting, None, 40)]):
        def deliver(item, i=i, spoken=speech is not None):
            items[i].append(item)
            if isinstance(item, BaseException) or (
                    item.speech is not None if isinstance(item, BatchAudio)
                    else not spoken and item.finish_reason is not None):
                done[i].set()

        inputs = prepare_inputs(processor, messages, feature_names=model.feature_names)
        engine.submit(inputs, SamplingOptions(max_tokens=max_tokens, temperature=0.0), deliver,
                      speech=speech)
    engine.start()
    try:
        assert all(event.wait(120) for event in done)
    finally:
        engine.close()
    assert engine.stats.peak_batch_size == 3
    for got, messages, voice in ((items[0], spoken[0], None), (items[1], spoken[1], "Ethan")):
        expected = our_speech(loaded, messages, {}, voice=voice)
        assert "".join(item.text for item in got if isinstance(item, BatchStep)) == expected.text
        np.testing.assert_array_equal(got[-1].speech.codes, expected.audio_codes)
        np.testing.assert_array_equal(got[-1].speech.audio, expected.audio)
    text = mlxvlm.generate(model, processor, counting, max_tokens=40, temperature=0.0)
    assert "".join(item.text for item in items[2]) == text.text


# ------------------------------------------------------------------ loading and converting


def test_a_thinker_only_checkpoint_loads_as_before_and_does_not_speak(tiny_checkpoints):
    model, processor = mlxvlm.load(str(tiny_checkpoints.path("qwen2_5_omni", "hub")))
    assert not model.speaks and "talker" not in model and "token2wav" not in model
    with pytest.raises(MlxvlmError, match="this model does not speak"):
        mlxvlm.generate(model, processor, "Hi", max_tokens=2, audio_output=True)


def test_a_quantized_conversion_quantizes_the_talker_and_keeps_token2wav_float(checkpoint,
                                                                               tmp_path):
    from mlxvlm.convert import convert

    convert(str(checkpoint), tmp_path / "q4", quantize=True, q_bits=4, q_group_size=32,
            quantize_vision=True)
    assert (tmp_path / "q4" / "spk_dict.pt").read_bytes() == (checkpoint / "spk_dict.pt").read_bytes()
    model, processor = mlxvlm.load(str(tmp_path / "q4"))
    assert model.speaks
    quantized = {path for path, module in model.named_modules() if "scales" in module}
    assert {"talker.model.layers.0.self_attn.q_proj", "talker.thinker_to_talker_proj",
            "talker.codec_head"} <= quantized
    assert not [path for path in quantized if path.startswith("token2wav")]
    # a prompt whose first greedy code from the 4-bit random talker is not an end code
    out = mlxvlm.generate(model, processor, "Describe a blue square.", max_tokens=4,
                          audio_output=True, talker_temperature=0, talker_max_frames=6)
    assert 0 < len(out.audio_codes) <= 6
    assert out.audio.shape == (len(out.audio_codes) * qwen2_5_omni_speech.SAMPLES_PER_CODE,)


# ------------------------------------------------------------------------------ the CLI


def test_the_generate_command_writes_the_speech_as_a_wav(loaded, checkpoint, tmp_path, capsys):
    from mlxvlm.generate.__main__ import main

    out = tmp_path / "answer.wav"
    code = main(["--model", str(checkpoint), "--prompt", "Describe a red circle.",
                 "--max-tokens", str(THINKER_TOKENS), "--audio-output", str(out),
                 "--voice", "Ethan", "--talker-temperature", "0",
                 "--talker-max-frames", str(FRAMES)])
    assert code == 0, capsys.readouterr().err
    expected = our_speech(loaded, [{"role": "user", "content": "Describe a red circle."}], {},
                          voice="Ethan")
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert wav.readframes(wav.getnframes()) == pcm16(expected.audio)
    assert main(["--model", str(checkpoint), "--prompt", "Hi", "--max-tokens", "2",
                 "--audio-output", str(tmp_path / "x.wav"), "--voice", "nobody"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: unknown voice 'nobody': this model's voices are Chelsie, Ethan")


# ------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server(checkpoint):
    from server_process import ServerProcess

    with ServerProcess("--model", str(checkpoint)) as process:
        yield process


def test_the_server_answers_with_the_speech_generate_makes(server, checkpoint, loaded):
    """``python -m mlxvlm.server``: a chat completion's audio and /v1/audio/speech, each
    the speech of the Python API for the same request; an unknown voice a 400 naming the
    voices."""
    import base64

    import openai

    from mlxvlm.generate.text import eos_token_ids
    from mlxvlm.server.speech import SAY_REQUEST
    from mlxvlm.speech.forced_answer import ForcedAnswer

    client = server.openai_client()
    messages = [{"role": "user", "content": "Describe a red circle."}]
    extra = {"talker_temperature": 0, "talker_max_frames": FRAMES}
    answer = client.chat.completions.create(
        model=str(checkpoint), messages=messages, max_tokens=THINKER_TOKENS, temperature=0,
        modalities=["text", "audio"], audio={"format": "pcm16", "voice": "Ethan"},
        extra_body=extra)
    expected = our_speech(loaded, messages, {}, voice="Ethan")
    assert answer.choices[0].message.audio.transcript == expected.text
    assert base64.b64decode(answer.choices[0].message.audio.data) == pcm16(expected.audio)

    said = "A red circle sits above a blue square."
    model, processor = loaded
    forced = ForcedAnswer.of_text(processor, said, eos_token_ids(processor))
    expected = mlxvlm.generate(
        model, processor, [{"role": "user", "content": SAY_REQUEST.format(text=said)}],
        max_tokens=len(forced.ids), logits_processors=[forced.processor(len(forced.ids))],
        audio_output=True, talker_temperature=0, talker_max_frames=FRAMES)
    assert expected.voice == "Chelsie"
    response = client.audio.speech.with_raw_response.create(
        model=str(checkpoint), input=said, response_format="pcm", voice=None, extra_body=extra)
    assert response.content == pcm16(expected.audio)

    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model=str(checkpoint), input=said, voice="alloy")
    assert caught.value.body["param"] == "voice"
    assert caught.value.body["message"].endswith("this model's voices are Chelsie, Ethan")


def test_the_server_streams_the_transcript_then_the_audio(server, checkpoint, loaded):
    import base64

    messages = [{"role": "user", "content": "Describe a red circle."}]
    stream = server.openai_client().chat.completions.create(
        model=str(checkpoint), messages=messages, max_tokens=THINKER_TOKENS, temperature=0,
        modalities=["text", "audio"], audio={"format": "pcm16", "voice": "Chelsie"},
        stream=True, extra_body={"talker_temperature": 0, "talker_max_frames": FRAMES})
    content, transcript, data = [], [], []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        audio = delta.audio.model_dump(exclude_none=True) if delta.audio else {}
        transcript.append(audio.get("transcript", ""))
        if "data" in audio:
            data.append(base64.b64decode(audio["data"]))
    expected = our_speech(loaded, messages, {})
    assert "".join(content) == "".join(transcript) == expected.text
    assert b"".join(data) == pcm16(expected.audio)  # token2wav's one chunk, at the end
