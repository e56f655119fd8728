"""Spoken answers as rows of the batching engine, through ``python -m mlxvlm.server`` with
the official ``openai`` client, on the tiny full Qwen3-Omni (tests/tiny/qwen3_omni_speech.py),
greedy thinker and talker (talker_temperature 0):

- two spoken answers and a text answer asked for at once each equal the same request
  asked for alone (text, audio bytes), and /metrics shows they decoded in one batch;
- a streamed spoken answer whose client leaves mid-way is stopped (the engine counts it
  cancelled) while another spoken answer being written beside it ends unchanged;
- /v1/audio/speech beside a chat spoken answer: each says what it says alone;
- a two-turn spoken conversation: the second turn reuses the first's prompt cache
  (``cached_tokens`` covers the first turn's prompt) and says what the same request says
  on a server started with the prompt cache off (``--prompt-cache-size 0``).

Their own server (a fresh one: its peak batch size starts below 2).
"""

from __future__ import annotations

import base64
import threading
import time

import httpx
import pytest

from server_process import ServerProcess

pytest.importorskip("torch")  # the tiny checkpoint is built with transformers' classes
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SPOKEN_TOKENS = 40  # long enough for two spoken rows' decoding to overlap
TEXT_TOKENS = 1000  # the text row still decoding while the spoken ones are written
FRAMES = 12
DESCRIBE = [{"role": "user", "content": "Describe a red circle."}]
SQUARE = [{"role": "user", "content": "Describe a blue square."}]
COUNT = [{"role": "user", "content": "Count to many."}]
SAID = "A red circle sits above a blue square."


@pytest.fixture(scope="module")
def server(speaking_checkpoint):
    with ServerProcess("--model", speaking_checkpoint) as process:
        yield process


@pytest.fixture(scope="module")
def client(server, speaking_checkpoint):
    """The server's client, the model it asks for in ``client.model``."""
    client = server.openai_client()
    client.model = speaking_checkpoint
    return client


def metric(server, name: str) -> float:
    """The sum of ``name``'s values in /metrics (one line per model)."""
    values = [float(line.split()[-1])
              for line in httpx.get(server.base_url + "/metrics", timeout=30).text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    assert values, f"no {name} in /metrics"
    return sum(values)


def spoken_completion(client, messages, voice: str | None = None):
    return client.chat.completions.create(
        model=client.model, messages=messages, max_tokens=SPOKEN_TOKENS, temperature=0,
        modalities=["text", "audio"],
        audio={"format": "pcm16"} | ({"voice": voice} if voice else {}),
        extra_body={"talker_temperature": 0, "talker_max_frames": FRAMES})


def spoken(client, messages, voice: str | None = None) -> tuple[str, bytes]:
    """A whole spoken answer's text and pcm16 audio."""
    message = spoken_completion(client, messages, voice).choices[0].message
    return message.content, base64.b64decode(message.audio.data)


def text_answer(client, messages, max_tokens: int) -> str:
    return client.chat.completions.create(
        model=client.model, messages=messages, max_tokens=max_tokens,
        temperature=0).choices[0].message.content


def said(client) -> bytes:
    return client.audio.speech.with_raw_response.create(
        model=client.model, input=SAID, response_format="pcm", voice="Ethan",
        extra_body={"talker_temperature": 0, "talker_max_frames": FRAMES}).content


def at_once(*calls) -> list:
    """Each call on a thread of its own, started together; their results in order."""
    results: list = [None] * len(calls)
    errors: list = []
    start = threading.Barrier(len(calls))

    def run(i, call):
        try:
            start.wait()
            results[i] = call()
        except BaseException as error:  # raised in the test below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def test_spoken_and_text_answers_decode_together_each_as_alone(server, client):
    assert metric(server, "mlxvlm_peak_batch_size") < 2  # a fresh server
    alone = [spoken(client, DESCRIBE), spoken(client, SQUARE, "Aiden"),
             text_answer(client, COUNT, TEXT_TOKENS)]
    assert metric(server, "mlxvlm_peak_batch_size") < 2  # one after the other
    together = at_once(lambda: text_answer(client, COUNT, TEXT_TOKENS),
                       lambda: spoken(client, DESCRIBE),
                       lambda: spoken(client, SQUARE, "Aiden"))
    assert together == [alone[2], alone[0], alone[1]]
    assert all(len(audio) for _, audio in alone[:2]) and alone[0][1] != alone[1][1]
    assert metric(server, "mlxvlm_peak_batch_size") >= 2


def test_a_client_leaving_a_spoken_answer_leaves_the_one_beside_it_whole(server, client):
    expected = spoken(client, SQUARE)
    before = metric(server, "mlxvlm_sequences_cancelled_total")
    # the random talker never ends: without the stop it would speak 4096 frames
    leaving = client.chat.completions.create(
        model=client.model, messages=DESCRIBE, max_tokens=6, temperature=0, stream=True,
        modalities=["text", "audio"], audio={"format": "pcm16"},
        extra_body={"talker_temperature": 0, "talker_max_frames": 4096})
    for chunk in leaving:
        if chunk.choices and chunk.choices[0].delta.audio and chunk.choices[0].delta.audio.data:
            break  # speaking has begun
    staying = client.chat.completions.create(
        model=client.model, messages=SQUARE, max_tokens=SPOKEN_TOKENS, temperature=0,
        stream=True, modalities=["text", "audio"], audio={"format": "pcm16"},
        extra_body={"talker_temperature": 0, "talker_max_frames": FRAMES})
    chunks = iter(staying)
    first = next(chunks)  # its first token is written: it is in the engine
    leaving.close()
    content, data = [], []
    for chunk in [first, *chunks]:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        if delta.audio and delta.audio.data:
            data.append(base64.b64decode(delta.audio.data))
    assert ("".join(content), b"".join(data)) == expected
    deadline = time.monotonic() + 120
    while metric(server, "mlxvlm_sequences_cancelled_total") == before:
        assert time.monotonic() < deadline, "the left spoken answer was not stopped"
        time.sleep(0.1)


def test_the_speech_endpoint_beside_a_spoken_chat_answer(client):
    alone = [said(client), spoken(client, DESCRIBE)]
    assert at_once(lambda: said(client), lambda: spoken(client, DESCRIBE)) == alone


def test_a_spoken_conversation_reuses_its_prompt_cache(client, speaking_checkpoint):
    first = spoken_completion(client, DESCRIBE)
    conversation = [*DESCRIBE, {"role": "assistant", "content": first.choices[0].message.content},
                    *SQUARE]
    second = spoken_completion(client, conversation)
    # the second turn's prompt starts with the first's
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    with ServerProcess("--model", speaking_checkpoint, "--prompt-cache-size", "0") as cold:
        cold_client = cold.openai_client()
        cold_client.model = speaking_checkpoint
        expected = spoken_completion(cold_client, conversation)
    assert expected.usage.prompt_tokens_details.cached_tokens == 0
    assert expected.usage.prompt_tokens == second.usage.prompt_tokens
    assert len(expected.choices[0].message.audio.data) > 0
    assert second.choices[0].message.content == expected.choices[0].message.content
    assert second.choices[0].message.audio.data == expected.choices[0].message.audio.data
