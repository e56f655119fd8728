"""Many users at once: parallel greedy requests answer exactly as sequential ones (they
really share decode steps), a full server answers 429 with Retry-After, and clients that
go away — while queued or while streaming — free their slots."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_harness import MODEL_ID, LiveServer, png_data_url, user, wait_until
from tiny import make_image

import mlxvlm

PROMPTS = [
    "Describe this image.",
    "What is in the picture?",
    "A red cat sits on a blue mat",
    "Hello there",
    "The quick brown fox",
    "Here is a photo of my garden.",
    "Compare the two images.",
    "Sure! The image shows a small house",
]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))


def conversation(index: int) -> list[dict]:
    if index % 3 == 0:  # some with an image, of different sizes
        return [user(PROMPTS[index], png_data_url(make_image(48 + 8 * index, 56, seed=index)))]
    return [{"role": "user", "content": PROMPTS[index]}]


def test_parallel_greedy_requests_equal_sequential_ones(loaded):
    # No prefix reuse, so that the only difference between the runs is the batching.
    with LiveServer(*loaded, max_concurrency=8, prompt_cache_size=0) as server:
        client = server.client()

        def ask(index: int) -> str:
            response = client.chat.completions.create(
                model=MODEL_ID, messages=conversation(index), temperature=0, max_tokens=48)
            return response.choices[0].message.content

        sequential = [ask(i) for i in range(8)]
        assert server.engine.stats.peak_batch_size == 1

        parallel: list[str | None] = [None] * 8
        start = threading.Barrier(8)

        def worker(index: int) -> None:
            start.wait()
            parallel[index] = ask(index)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert parallel == sequential
        assert server.engine.stats.peak_batch_size > 1  # they did share decode steps


def open_raw_request(server: LiveServer, body: dict) -> socket.socket:
    """Send a chat request on a raw socket and leave it waiting (closing the socket is
    the client going away)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    return sock


@pytest.fixture
def slow_decoding(monkeypatch):
    """Slow each decode step a little, so that a long answer is still running while the
    test acts (this throttles the engine; it does not synchronise anything)."""

    def apply(engine):
        original = engine._decode_step

        def throttled():
            time.sleep(0.005)
            original()

        monkeypatch.setattr(engine, "_decode_step", throttled)

    return apply


def test_full_server_says_429_and_gone_clients_free_their_slots(loaded, slow_decoding):
    with LiveServer(*loaded, max_concurrency=1, max_queue=1) as server:
        slow_decoding(server.engine)
        stats, service = server.engine.stats, server.service
        long_answer = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello"}],
                       "temperature": 0, "max_tokens": 900}
        url = f"{server.base_url}/v1/chat/completions"

        with httpx.stream("POST", url, json={**long_answer, "stream": True}, timeout=60) as a:
            events = a.iter_lines()
            assert next(events).startswith("data: ")  # A is decoding in the only slot
            queued = open_raw_request(server, long_answer)  # B waits for it
            assert wait_until(lambda: stats.waiting == 1)

            full = httpx.post(url, json=long_answer, timeout=60)  # C: no room
            assert full.status_code == 429
            assert int(full.headers["retry-after"]) >= 1
            assert full.json()["error"]["type"] == "rate_limit_error"
            assert full.json()["error"]["code"] == "rate_limit_exceeded"

            queued.close()  # B goes away while queued
            assert wait_until(lambda: stats.waiting == 0 and service.in_flight == 1)
            assert stats.requests_cancelled == 1
            generated_at_close = stats.generated_tokens
        # A goes away while streaming: its slot is freed within a few tokens.
        assert wait_until(lambda: stats.active == 0 and service.in_flight == 0)
        assert stats.requests_cancelled == 2
        assert stats.generated_tokens - generated_at_close < 20
        assert stats.generated_tokens < 900

        # The server serves the next request at once.
        response = httpx.post(url, json={**long_answer, "max_tokens": 4}, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 4


def test_client_gone_before_the_answer_frees_its_slot(loaded, slow_decoding):
    """A non-streaming client that hangs up while its answer is being generated."""
    with LiveServer(*loaded, max_concurrency=2) as server:
        slow_decoding(server.engine)
        stats = server.engine.stats
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello there"}],
                "temperature": 0, "max_tokens": 900}
        sock = open_raw_request(server, body)
        assert wait_until(lambda: stats.generated_tokens > 5)
        sock.close()
        assert wait_until(lambda: stats.active == 0 and server.service.in_flight == 0)
        assert stats.requests_cancelled == 1 and stats.generated_tokens < 900
