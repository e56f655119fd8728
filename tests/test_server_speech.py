"""Spoken answers through ``python -m mlxvlm.server`` with the official ``openai`` client,
on the tiny full Qwen3-Omni (tests/tiny/qwen3_omni_speech.py):

- chat completions with ``modalities`` ["text", "audio"]: ``message.audio``'s data
  (a WAV file, or raw 16-bit PCM for pcm16) holds the samples ``mlxvlm.generate(...,
  audio_output=True)`` speaks for the same prompt, voice and talker_temperature 0, its
  transcript the answer's text;
- the 400s: a model without a talker, an unknown voice (named among the voices), a format
  other than wav/pcm16 (pcm16 alone when streamed), audio fields without the audio
  modality;
- streamed: the transcript and content deltas are the answer, the audio chunks' pcm16
  concatenate to generate's speech, and audio arrives while the text is still being
  written (the talker follows the thinker);
- a seed reproduces the sampled talker as the Python API draws it; a spoken answer that
  fails mid-speech (in process, a stage made to fail) fails alone, the engine serving the
  next text and spoken answers;
- ``/v1/audio/speech`` says its input as the Python API speaks the same forced answer
  (raw PCM streamed, chunked).
One server serves both the speaking checkpoint and a thinker-only one. Spoken answers
beside others in the engine's batch, and a client leaving one: test_server_spoken_batching.
"""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest

from server_process import ServerProcess

import mlxvlm
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.server.speech import SAY_REQUEST
from mlxvlm.speech.forced_answer import ForcedAnswer
from mlxvlm.speech.wav import pcm16

pytest.importorskip("torch")  # the tiny checkpoint is built with transformers' classes
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

THINKER_TOKENS = 6
FRAMES = 12  # the random talker never ends: a few frames
MESSAGES = [{"role": "user", "content": "Describe a red circle."}]


@pytest.fixture(scope="module")
def thinker_only(tiny_checkpoints):
    return str(tiny_checkpoints.path("qwen3_omni_moe", "hub"))


@pytest.fixture(scope="module")
def server(speaking_checkpoint, thinker_only):
    with ServerProcess("--model", speaking_checkpoint, "--model", thinker_only) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def loaded(speaking_checkpoint):
    return mlxvlm.load(speaking_checkpoint)


def reference(loaded, voice: str | None) -> mlxvlm.GenerationOutput:
    model, processor = loaded
    return mlxvlm.generate(model, processor, MESSAGES, max_tokens=THINKER_TOKENS,
                           temperature=0.0, audio_output=True, voice=voice,
                           talker_temperature=0, talker_max_frames=FRAMES)


def chat(client, model: str, **fields):
    return client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=THINKER_TOKENS, temperature=0,
        **fields)


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as audio:
        assert (audio.getnchannels(), audio.getsampwidth()) == (1, 2)
        return np.frombuffer(audio.readframes(audio.getnframes()), "<i2"), audio.getframerate()


@pytest.mark.parametrize("fmt,voice", [("wav", "Chelsie"), ("pcm16", None)])
def test_a_spoken_answer_is_the_speech_generate_makes(client, speaking_checkpoint, loaded, fmt,
                                                      voice):
    expected = reference(loaded, voice)
    expected_samples = np.frombuffer(pcm16(expected.audio), "<i2")
    assert len(expected_samples) > 0
    audio = {"format": fmt} | ({"voice": voice} if voice else {})
    answer = chat(client, speaking_checkpoint, modalities=["text", "audio"], audio=audio,
                  extra_body={"talker_temperature": 0, "talker_max_frames": FRAMES})
    message = answer.choices[0].message
    assert message.content == expected.text
    assert message.audio.transcript == expected.text
    assert message.audio.id and message.audio.expires_at > 0
    data = base64.b64decode(message.audio.data)
    if fmt == "wav":
        samples, rate = wav_samples(data)
        assert rate == expected.sample_rate == 24000
    else:
        samples = np.frombuffer(data, "<i2")
    np.testing.assert_array_equal(samples, expected_samples)
    assert answer.usage.completion_tokens == expected.generation_tokens


def test_a_streamed_spoken_answer_sends_audio_while_the_text_is_written(
        client, speaking_checkpoint, loaded):
    expected = reference(loaded, "Chelsie")
    stream = chat(client, speaking_checkpoint, modalities=["text", "audio"],
                  audio={"voice": "Chelsie", "format": "pcm16"}, stream=True,
                  stream_options={"include_usage": True},
                  extra_body={"talker_temperature": 0, "talker_max_frames": FRAMES})
    content, transcript, data, finish, usage, ids = [], [], [], [], None, set()
    order = []  # "text" / "audio" per delta, as they arrive
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        audio = delta.audio.model_dump(exclude_none=True) if delta.audio else {}
        ids.update([audio["id"]] if "id" in audio else [])
        transcript.append(audio.get("transcript", ""))
        if "data" in audio:
            data.append(base64.b64decode(audio["data"]))
            order.append("audio")
        if delta.content:
            order.append("text")
        finish.append(chunk.choices[0].finish_reason)
    assert "".join(content) == "".join(transcript) == expected.text
    assert len(ids) == 1 and len(data) > 1  # the codec's chunks as they are decoded
    np.testing.assert_array_equal(np.frombuffer(b"".join(data), "<i2"),
                                  np.frombuffer(pcm16(expected.audio), "<i2"))
    assert finish[-1] == expected.finish_reason
    assert usage.completion_tokens == expected.generation_tokens
    # the talker follows the thinker: audio arrives before the text's last delta
    assert order.index("audio") < len(order) - 1 - order[::-1].index("text")


def test_a_seed_reproduces_the_sampled_talker(client, speaking_checkpoint, loaded):
    """talker_temperature left out: the checkpoint's talker sampling, drawn from the
    request's seed as the Python API draws it."""
    model, processor = loaded
    expected = mlxvlm.generate(model, processor, MESSAGES, max_tokens=THINKER_TOKENS,
                               temperature=0.0, seed=5, audio_output=True,
                               talker_max_frames=FRAMES)
    answer = chat(client, speaking_checkpoint, modalities=["text", "audio"],
                  audio={"format": "pcm16"}, seed=5,
                  extra_body={"talker_max_frames": FRAMES})
    np.testing.assert_array_equal(
        np.frombuffer(base64.b64decode(answer.choices[0].message.audio.data), "<i2"),
        np.frombuffer(pcm16(expected.audio), "<i2"))


def test_a_spoken_answer_failing_mid_speech_fails_alone(loaded, monkeypatch):
    """In process (a stage made to fail): the codec raises after a few frames (where
    every talker frame goes, stepped alone or batched), while the text is still being
    written; the stream ends with an error event, and the engine serves the next text and
    spoken answers."""
    from server_harness import LiveServer

    from mlxvlm.speech.pipeline import AnswerSpeaker

    took = AnswerSpeaker.took

    def failing_took(self, frame):
        if len(self.frames) == 3:
            raise RuntimeError("the codec broke")
        return took(self, frame)

    model, processor = loaded
    expected = reference(loaded, None)
    with LiveServer(model, processor) as live:
        client = live.client()
        with monkeypatch.context() as patch:
            patch.setattr(AnswerSpeaker, "took", failing_took)
            stream = chat(client, live.config.model_id, modalities=["text", "audio"],
                          audio={"format": "pcm16"}, stream=True,
                          extra_body={"talker_temperature": 0, "talker_max_frames": FRAMES})
            with pytest.raises(openai.APIError):
                for _ in stream:
                    pass
        assert chat(client, live.config.model_id).choices[0].message.content
        answer = chat(client, live.config.model_id, modalities=["text", "audio"],
                      audio={"format": "pcm16"},
                      extra_body={"talker_temperature": 0, "talker_max_frames": FRAMES})
    np.testing.assert_array_equal(
        np.frombuffer(base64.b64decode(answer.choices[0].message.audio.data), "<i2"),
        np.frombuffer(pcm16(expected.audio), "<i2"))


def test_the_voice_changes_the_speech(client, speaking_checkpoint):
    def spoken(voice):
        answer = chat(client, speaking_checkpoint, modalities=["text", "audio"],
                      audio={"voice": voice, "format": "pcm16"},
                      extra_body={"talker_temperature": 0, "talker_max_frames": FRAMES})
        return base64.b64decode(answer.choices[0].message.audio.data)

    assert spoken("ethan") != spoken("Aiden")


def refusal(client, model: str, **fields) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, model, **fields)
    return caught.value


def test_a_model_without_a_talker_is_refused(client, thinker_only):
    error = refusal(client, thinker_only, modalities=["text", "audio"],
                    audio={"voice": "Ethan", "format": "wav"})
    assert error.body["param"] == "modalities"
    assert "does not speak" in error.body["message"]


def test_an_unknown_voice_is_refused_naming_the_voices(client, speaking_checkpoint):
    error = refusal(client, speaking_checkpoint, modalities=["text", "audio"],
                    audio={"voice": "alloy", "format": "wav"})
    assert error.body["param"] == "audio.voice"
    assert "'alloy'" in error.body["message"]
    for voice in ("Aiden", "Chelsie", "Ethan"):
        assert voice in error.body["message"]


@pytest.mark.parametrize("fields,param", [
    ({"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "mp3"}},
     "audio.format"),
    ({"audio": {"voice": "Ethan", "format": "wav"}}, "audio"),
    ({"extra_body": {"talker_temperature": 0}}, "talker_temperature"),
    ({"modalities": ["text", "audio"], "extra_body": {"talker_max_frames": 0}},
     "talker_max_frames"),
    ({"modalities": ["text", "audio"], "extra_body": {"talker_temperature": -1}},
     "talker_temperature"),
    ({"modalities": ["text", "audio"], "stream": True}, "audio.format"),
    ({"modalities": ["text", "audio"], "response_format": {"type": "json_object"}},
     "modalities"),
    ({"modalities": ["text", "audio"], "logprobs": True}, "logprobs"),
])
def test_audio_fields_that_cannot_be_served_are_refused(client, speaking_checkpoint, fields,
                                                       param):
    assert refusal(client, speaking_checkpoint, **fields).body["param"] == param


def test_text_answers_still_come_from_the_engine(client, speaking_checkpoint):
    answer = chat(client, speaking_checkpoint)
    assert answer.choices[0].message.audio is None
    assert answer.choices[0].message.content


# ------------------------------------------------------------------ /v1/audio/speech

SAID = "A red circle sits above a blue square."


def said_by_generate(loaded, voice: str | None) -> mlxvlm.GenerationOutput:
    """``SAID`` spoken through the Python API: the speech endpoint's conversation, its
    answer forced to the text."""
    model, processor = loaded
    forced = ForcedAnswer.of_text(processor, SAID, eos_token_ids(processor))
    return mlxvlm.generate(
        model, processor, [{"role": "user", "content": SAY_REQUEST.format(text=SAID)}],
        max_tokens=len(forced.ids), logits_processors=[forced.processor(len(forced.ids))],
        audio_output=True, voice=voice, talker_temperature=0, talker_max_frames=FRAMES)


@pytest.mark.parametrize("fmt,voice", [("wav", "aiden"), ("pcm", None)])
def test_the_speech_endpoint_says_the_input(client, speaking_checkpoint, loaded, fmt, voice):
    expected = said_by_generate(loaded, voice)
    assert expected.text == SAID
    # the client needs a voice; None (JSON null) asks for the checkpoint's default
    response = client.audio.speech.with_raw_response.create(
        model=speaking_checkpoint, input=SAID, response_format=fmt, voice=voice,
        extra_body={"talker_temperature": 0, "talker_max_frames": FRAMES})
    assert response.headers["content-type"] == f"audio/{fmt}"
    data = response.content
    if fmt == "wav":
        samples, rate = wav_samples(data)
        assert rate == 24000
        assert int(response.headers["content-length"]) == len(data)
    else:  # streamed as the codec decodes it
        samples = np.frombuffer(data, "<i2")
        assert response.headers["transfer-encoding"] == "chunked"
    np.testing.assert_array_equal(samples, np.frombuffer(pcm16(expected.audio), "<i2"))


def test_the_speech_endpoint_draws_the_sampled_talker_from_the_seed(client, speaking_checkpoint,
                                                                    loaded):
    model, processor = loaded
    forced = ForcedAnswer.of_text(processor, SAID, eos_token_ids(processor))
    expected = mlxvlm.generate(
        model, processor, [{"role": "user", "content": SAY_REQUEST.format(text=SAID)}],
        max_tokens=len(forced.ids), logits_processors=[forced.processor(len(forced.ids))],
        audio_output=True, seed=11, talker_max_frames=FRAMES)
    response = client.audio.speech.with_raw_response.create(
        model=speaking_checkpoint, input=SAID, response_format="pcm", voice="Ethan",
        extra_body={"seed": 11, "talker_max_frames": FRAMES})
    np.testing.assert_array_equal(np.frombuffer(response.content, "<i2"),
                                  np.frombuffer(pcm16(expected.audio), "<i2"))


@pytest.mark.parametrize("fields,param", [
    ({"voice": "alloy"}, "voice"),
    ({"extra_body": {"seed": "x"}}, "seed"),
    ({"response_format": "mp3"}, "response_format"),
    ({"input": ""}, "input"),
])
def test_the_speech_endpoint_refuses_what_it_cannot_say(client, speaking_checkpoint, fields,
                                                       param):
    request = {"model": speaking_checkpoint, "input": SAID, "voice": "Ethan", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(**request)
    assert caught.value.body["param"] == param


def test_the_speech_endpoint_refuses_a_model_without_a_talker(client, thinker_only):
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model=thinker_only, input=SAID, voice="Ethan")
    assert caught.value.body["param"] == "model"
    assert "does not speak" in caught.value.body["message"]
