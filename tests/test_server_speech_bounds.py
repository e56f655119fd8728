"""The server's bounds on spoken answers, through ``python -m mlxvlm.server`` on the tiny
full Qwen3-Omni (tests/tiny/qwen3_omni_speech.py), whose random talker never ends its
speech by itself (so every answer runs to its frame bound):

- ``--max-speech-seconds``: a request asking for more frames than it allows is a 400
  naming the bound (chat completions and /v1/audio/speech); one that does not say is
  cut there -- its audio is what ``mlxvlm.generate`` speaks with that many frames;
- ``--max-speech-input-chars``: a longer /v1/audio/speech input is a 400 naming it;
- /v1/audio/speech is behind the API key, the body limit and admission (429 when busy);
- a client that leaves while its answer is being spoken (not streamed) stops the talker
  there (the server says it stopped speaking), and the next request is served whole.

The tiny code2wav makes 24 samples a frame: 1000 frames a second of 24 kHz audio.
"""

from __future__ import annotations

import base64
import json
import time

import httpx
import numpy as np
import pytest

from raw_http import raw_socket
from server_process import ServerProcess

import mlxvlm
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.server.speech import SAY_REQUEST
from mlxvlm.speech.forced_answer import ForcedAnswer
from mlxvlm.speech.wav import pcm16

pytest.importorskip("torch")  # the tiny checkpoint is built with transformers' classes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KEY = "speech-bounds-key"
LIMIT_FRAMES = 12
LIMIT_SECONDS = "0.012"  # 12 frames of the tiny codec
INPUT_CHARS = 48
THINKER_TOKENS = 6
MESSAGES = [{"role": "user", "content": "Describe a red circle."}]
SAID = "A red circle sits above a blue square."  # 38 characters
WAIT_S = 120


@pytest.fixture(scope="module")
def loaded(speaking_checkpoint):
    return mlxvlm.load(speaking_checkpoint)


@pytest.fixture(scope="module")
def bounded(speaking_checkpoint):
    with ServerProcess("--model", speaking_checkpoint, "--api-key", KEY,
                       "--max-speech-seconds", LIMIT_SECONDS,
                       "--max-speech-input-chars", str(INPUT_CHARS),
                       "--max-body-bytes", "4096") as process:
        yield process


@pytest.fixture(scope="module")
def busy(speaking_checkpoint):
    """One request at a time, none waiting; the default speech bounds."""
    with ServerProcess("--model", speaking_checkpoint, "--max-concurrency", "1",
                       "--max-queue", "0") as process:
        yield process


def post(server, path: str, body: dict, key: str | None = KEY, **fields) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=WAIT_S,
                      **fields)


def chat_body(model: str, **fields) -> dict:
    return {"model": model, "messages": MESSAGES, "max_tokens": THINKER_TOKENS,
            "temperature": 0, "modalities": ["text", "audio"],
            "audio": {"format": "pcm16"}, "talker_temperature": 0, **fields}


def speech_body(model: str, **fields) -> dict:
    return {"model": model, "input": SAID, "response_format": "pcm",
            "talker_temperature": 0, **fields}


def spoken_samples(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["choices"][0]["message"]["audio"]["data"])
    return np.frombuffer(data, "<i2")


def generated_speech(loaded, frames: int) -> np.ndarray:
    model, processor = loaded
    out = mlxvlm.generate(model, processor, MESSAGES, max_tokens=THINKER_TOKENS,
                          temperature=0.0, audio_output=True, talker_temperature=0,
                          talker_max_frames=frames)
    return np.frombuffer(pcm16(out.audio), "<i2")


def said_speech(loaded, frames: int) -> np.ndarray:
    """``SAID`` as the speech endpoint has the model say it, through the Python API."""
    model, processor = loaded
    forced = ForcedAnswer.of_text(processor, SAID, eos_token_ids(processor))
    out = mlxvlm.generate(
        model, processor, [{"role": "user", "content": SAY_REQUEST.format(text=SAID)}],
        max_tokens=len(forced.ids), logits_processors=[forced.processor(len(forced.ids))],
        audio_output=True, talker_temperature=0, talker_max_frames=frames)
    return np.frombuffer(pcm16(out.audio), "<i2")


def refused_for(server) -> dict[str, float]:
    counts = {}
    for line in httpx.get(server.base_url + "/metrics", timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}).text.splitlines():
        if line.startswith("mlxvlm_requests_refused_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            counts[reason] = float(line.split()[-1])
    return counts


def test_more_speech_than_the_bound_is_a_400_naming_it(bounded, speaking_checkpoint):
    before = refused_for(bounded).get("max_speech_seconds", 0)
    for path, body in [
        ("/v1/chat/completions", chat_body(speaking_checkpoint,
                                           talker_max_frames=LIMIT_FRAMES + 1)),
        ("/v1/audio/speech", speech_body(speaking_checkpoint,
                                         talker_max_frames=LIMIT_FRAMES + 1)),
    ]:
        response = post(bounded, path, body)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == "talker_max_frames"
        assert f"at most {LIMIT_FRAMES} frames" in error["message"]
        assert "--max-speech-seconds" in error["message"]
    assert refused_for(bounded)["max_speech_seconds"] == before + 2


def test_speech_that_does_not_say_its_length_is_cut_at_the_bound(bounded, speaking_checkpoint,
                                                               loaded):
    expected = generated_speech(loaded, LIMIT_FRAMES)
    assert len(expected) > 0
    np.testing.assert_array_equal(
        spoken_samples(post(bounded, "/v1/chat/completions", chat_body(speaking_checkpoint))),
        expected)
    # the bound itself is allowed
    np.testing.assert_array_equal(
        spoken_samples(post(bounded, "/v1/chat/completions",
                            chat_body(speaking_checkpoint, talker_max_frames=LIMIT_FRAMES))),
        expected)
    said = post(bounded, "/v1/audio/speech", speech_body(speaking_checkpoint))
    assert said.status_code == 200, said.text
    np.testing.assert_array_equal(np.frombuffer(said.content, "<i2"),
                                  said_speech(loaded, LIMIT_FRAMES))


def test_a_longer_speech_input_is_a_400_naming_the_bound(bounded, speaking_checkpoint):
    text = "x" * (INPUT_CHARS + 1)
    response = post(bounded, "/v1/audio/speech", speech_body(speaking_checkpoint, input=text))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input"
    assert f"at most {INPUT_CHARS}" in error["message"]
    assert "--max-speech-input-chars" in error["message"]
    assert refused_for(bounded)["max_speech_input_chars"] >= 1
    at_bound = post(bounded, "/v1/audio/speech",
                    speech_body(speaking_checkpoint, input="y" * INPUT_CHARS))
    assert at_bound.status_code == 200, at_bound.text


def test_the_speech_endpoint_is_behind_the_key_and_the_body_limit(bounded,
                                                                  speaking_checkpoint):
    assert post(bounded, "/v1/audio/speech", speech_body(speaking_checkpoint),
                key=None).status_code == 401
    assert post(bounded, "/v1/audio/speech", speech_body(speaking_checkpoint),
                key="wrong").status_code == 401
    big = post(bounded, "/v1/audio/speech",
               speech_body(speaking_checkpoint, input="word " * 1000))
    assert big.status_code == 413, big.text
    as_form = httpx.post(bounded.base_url + "/v1/audio/speech", timeout=WAIT_S,
                         headers={"Authorization": f"Bearer {KEY}"},
                         data={"model": speaking_checkpoint, "input": SAID})
    assert as_form.status_code == 415, as_form.text


def metric(server, name: str) -> float:
    for line in httpx.get(server.base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def cancelled(server) -> float:
    """Spoken answers are rows of the engine: a client's leaving stops its row."""
    return metric(server, "mlxvlm_sequences_cancelled_total")


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_client_leaving_while_its_answer_is_spoken_stops_it(busy, speaking_checkpoint,
                                                               loaded):
    before = cancelled(busy)
    # 4096 frames: seconds of speech the tiny talker would go on with, never ending
    body = json.dumps(speech_body(speaking_checkpoint, talker_max_frames=4096)).encode()
    client = raw_socket(busy.port, b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Content-Type: application/json\r\nContent-Length: "
                        + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        wait_until(lambda: metric(busy, "mlxvlm_active_sequences") >= 1,
                   "the answer to be written and spoken")
        # the one admission slot is taken: the speech endpoint is refused as others are
        refused = post(busy, "/v1/audio/speech", speech_body(speaking_checkpoint), key=None)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"]
    finally:
        client.close()
    wait_until(lambda: cancelled(busy) > before, "the spoken answer to be stopped")
    wait_until(lambda: metric(busy, "mlxvlm_active_sequences") == 0,
               "the engine to free its row and its talker")
    # the model is free again: the next spoken answer is whole
    np.testing.assert_array_equal(
        spoken_samples(post(busy, "/v1/chat/completions",
                            chat_body(speaking_checkpoint, talker_max_frames=LIMIT_FRAMES),
                            key=None)),
        generated_speech(loaded, LIMIT_FRAMES))
