"""The Responses API's store (``response_store``) on its own: its byte estimate against
the memory Python really holds for it (tracemalloc), an image kept once per key however
many conversations hold it, the conversation given back as sent, and the bounds: a key's
own least recently used make room, never another key's, and what cannot fit is refused."""

from __future__ import annotations

import base64
import gc
import os
import tracemalloc

import pytest

from mlxvlm.errors import MlxvlmError
from mlxvlm.server.config import build_parser, config_from_args
from mlxvlm.server.response_store import ResponseStore

MiB = 2**20


def data_url(size: int, seed: int) -> str:
    """A data URL of about ``size`` characters (the store never decodes it)."""
    data = seed.to_bytes(4, "big") + os.urandom(size * 3 // 4 - 4)
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(text: str, url: str | None = None) -> dict:
    if url is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


def answered(*messages: dict) -> list[dict]:
    return [*messages, {"role": "assistant", "content": "A picture."}]


def store(**bounds) -> ResponseStore:
    bounds.setdefault("max_items", 100)
    bounds.setdefault("max_key_bytes", 64 * MiB)
    bounds.setdefault("max_total_bytes", 256 * MiB)
    return ResponseStore(bounds["max_items"], bounds["max_key_bytes"],
                         bounds["max_total_bytes"])


def held_by(build) -> tuple[ResponseStore, int]:
    """The store ``build`` fills, and the bytes Python allocated for it (what is still
    held once everything else ``build`` made is gone)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        return kept, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_the_byte_estimate_is_the_memory_held():
    def build():
        kept = store()
        for n in range(3):
            assert kept.put("key", f"resp_{n}", answered(user("What is it?", data_url(MiB, n))))
        return kept

    kept, held = held_by(build)
    assert 3 * MiB <= kept.bytes < 3.1 * MiB
    assert abs(held - kept.bytes) < 0.05 * held


def test_an_image_is_kept_once_per_key_however_many_conversations_hold_it():
    def build():
        url = data_url(MiB, 1)
        kept = store()
        first = answered(user("What is it?", url))
        assert kept.put("key", "resp_1", first)
        # Continued from the kept conversation (as the route does) ...
        earlier = kept.get("key", "resp_1")
        assert kept.put("key", "resp_2", earlier + answered(user("And its colour?")))
        # ... and the same picture sent again whole, as another string.
        again = (url + " ")[:-1]
        assert again is not url
        assert kept.put("key", "resp_3", answered(user("What is it?", again)))
        return kept

    kept, held = held_by(build)
    assert MiB <= kept.bytes < 1.1 * MiB
    assert abs(held - kept.bytes) < 0.05 * held
    # Another key holds its own copy (nothing is shared between keys).
    url = kept.get("key", "resp_1")[0]["content"][0]["image_url"]["url"]
    assert kept.put("other", "resp_4", answered(user("What is it?", url)))
    assert 2 * MiB <= kept.bytes < 2.2 * MiB


def test_a_kept_conversation_comes_back_as_it_was_sent():
    url = data_url(4096, 7)
    conversation = answered(user("What is it?", url))
    conversation[-1]["tool_calls"] = [{"id": "call_1", "type": "function", "function": {
        "name": "look", "arguments": "{}"}}]
    kept = store()
    assert kept.put("key", "resp_1", conversation)
    assert kept.get("key", "resp_1") == conversation
    assert kept.get("other", "resp_1") is None and kept.get("key", "resp_2") is None


def test_a_key_makes_room_among_its_own_never_another_keys():
    kept = store(max_items=3, max_key_bytes=int(2.5 * MiB))
    assert kept.put("bystander", "resp_b", answered(user("Hi", data_url(MiB, 0))))
    for n in range(3):  # the third image does not fit beside two: the key's oldest goes
        assert kept.put("flood", f"resp_{n}", answered(user("Hi", data_url(MiB, n + 1))))
    assert kept.get("flood", "resp_0") is None
    assert kept.get("flood", "resp_1") is not None and kept.get("flood", "resp_2") is not None
    assert kept.evicted == 1
    for n in range(3, 6):  # at most 3 per key
        assert kept.put("flood", f"resp_{n}", answered(user("Hi")))
    assert [kept.get("flood", f"resp_{n}") is not None for n in range(6)] == [
        False, False, False, True, True, True]
    assert kept.evicted == 3
    assert kept.get("bystander", "resp_b") is not None
    assert len(kept) == 4


def test_what_cannot_fit_is_refused_and_nothing_is_evicted_for_it():
    kept = store(max_key_bytes=int(2.5 * MiB), max_total_bytes=int(3.5 * MiB))
    assert kept.put("one", "resp_1", answered(user("Hi", data_url(MiB, 1))))
    assert kept.put("two", "resp_2", answered(user("Hi", data_url(MiB, 2))))
    assert kept.put("two", "resp_3", answered(user("Hi", data_url(MiB, 3))))
    # Larger than a key may hold: refused, the key's own kept.
    assert not kept.put("one", "resp_4", answered(user("Hi", data_url(3 * MiB, 4))))
    # The server's bound is full of the others': a third key is refused, the others stay.
    before = kept.bytes
    assert not kept.put("three", "resp_5", answered(user("Hi", data_url(MiB, 5))))
    assert (kept.refused, kept.evicted, kept.bytes) == (2, 0, before)
    assert all(kept.get(key, rid) is not None for key, rid in
               (("one", "resp_1"), ("two", "resp_2"), ("two", "resp_3")))
    # A key within its bound makes room among its own for the total's sake.
    assert kept.put("one", "resp_6", answered(user("Hi", data_url(MiB, 6))))
    assert kept.get("one", "resp_1") is None and kept.evicted == 1
    assert kept.bytes <= 3.5 * MiB


def test_a_store_of_no_responses_keeps_none():
    kept = store(max_items=0)
    assert not kept.put("key", "resp_1", answered(user("Hi")))
    assert (len(kept), kept.refused) == (0, 0)


def test_the_command_line_bounds():
    def config(*argv):
        return config_from_args(build_parser().parse_args(["--model", "m", *argv]))

    default = config()
    assert (default.max_stored_responses, default.max_stored_response_bytes,
            default.max_total_stored_response_bytes) == (256, 128 * MiB, 512 * MiB)
    given = config("--max-stored-response-bytes", "1000",
                   "--max-total-stored-response-bytes", "5000")
    assert (given.max_stored_response_bytes, given.max_total_stored_response_bytes) == (
        1000, 5000)
    with pytest.raises(MlxvlmError, match="must be at least max_stored_response_bytes"):
        config("--max-stored-response-bytes", "2000", "--max-total-stored-response-bytes",
               "1000")
