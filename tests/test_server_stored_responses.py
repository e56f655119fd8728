"""The Responses store's bounds through the real entry point (``python -m mlxvlm.server``
with three API keys): a key storing large pictures makes room among its own responses
only, by bytes and by count; the bystander key's stored conversation still continues
with the answer the whole conversation gets when sent again; a response that no longer
fits the server's bound is answered but not stored (``store: false``), and /metrics
counts the evictions and refusals and the bytes held."""

from __future__ import annotations

import base64
import io
import re

import httpx
import numpy as np
import pytest
from PIL import Image
from server_process import ServerProcess

MiB = 2**20
KEYS = ("key-flood", "key-bystander", "key-late")
QUESTION = "What is in the picture?"


def noise_png_url(seed: int, side: int = 512) -> str:
    """A data URL of a PNG of noise (which does not compress): about 1 MiB of text."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def picture_turn(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                         {"type": "input_text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    model = str(tiny_checkpoints.path("qwen2_vl", "hub"))
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    with ServerProcess("--model", model, *keys, "--max-stored-responses", "3",
                       "--max-stored-response-bytes", str(int(2.5 * MiB)),
                       "--max-total-stored-response-bytes", str(int(3.5 * MiB))) as live:
        live.model = model
        yield live


def respond(server, key: str, input, **fields) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/responses", timeout=120,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": server.model, "input": input, "temperature": 0,
                            "max_output_tokens": 12, **fields})


def answer(server, key: str, input, **fields) -> dict:
    response = respond(server, key, input, **fields)
    assert response.status_code == 200, response.text
    return response.json()


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def continued(server, key: str, earlier: dict, earlier_input: list[dict]) -> str:
    """The continuation of ``earlier``, checked against the whole conversation sent
    again without the store."""
    follow_up = [{"role": "user", "content": "And its colours?"}]
    reply = answer(server, key, follow_up, previous_response_id=earlier["id"])
    whole = earlier_input + [{"role": "assistant", "content": text_of(earlier)}] + follow_up
    assert text_of(reply) == text_of(answer(server, key, whole, store=False))
    return text_of(reply)


def not_found(server, key: str, response_id: str) -> bool:
    refused = respond(server, key, "And?", previous_response_id=response_id)
    return (refused.status_code == 400
            and refused.json()["error"]["code"] == "previous_response_not_found")


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics",
                     headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30).text
    return {name: float(value) for name, value in
            re.findall(r"^(mlxvlm_stored_\w+) (\S+)$", text, re.M)}


def test_one_keys_pictures_never_evict_anothers_and_the_store_stays_bounded(server):
    flood, bystander, late = KEYS
    bystander_input = picture_turn(noise_png_url(0))
    kept = answer(server, bystander, bystander_input)
    assert kept["store"] is True
    # Three pictures of ~1 MiB under a 2.5 MiB bound: the flooding key's first goes.
    flood_inputs = [picture_turn(noise_png_url(seed)) for seed in (1, 2, 3)]
    flooded = [answer(server, flood, turn) for turn in flood_inputs]
    assert all(response["store"] is True for response in flooded)
    assert not_found(server, flood, flooded[0]["id"])
    continued(server, flood, flooded[2], flood_inputs[2])
    # The server's 3.5 MiB hold the bystander's picture and two of the flood's: a third
    # key's picture does not fit, is answered, and is not stored.
    refused = answer(server, late, picture_turn(noise_png_url(4)))
    assert refused["store"] is False and text_of(refused)
    assert not_found(server, late, refused["id"])
    # Text answers past 3 for the flooding key drop its own, never the bystander's.
    for _ in range(3):
        answer(server, flood, "Name a colour.")
    assert not_found(server, flood, flooded[2]["id"])
    continued(server, bystander, kept, bystander_input)
    counts = metrics(server)
    # Kept: the bystander's picture and its continuation, the flood's 3 texts. Evicted:
    # the flood's first picture (bytes), then by count its pictures 2 and 3 and the
    # continuation of the third.
    assert counts["mlxvlm_stored_responses"] == 5
    assert counts["mlxvlm_stored_responses_evicted_total"] == 4
    assert counts["mlxvlm_stored_responses_refused_total"] == 1
    # One picture's bytes (~1 MiB, shared by the bystander's two), not the flood's.
    assert 0.9 * MiB < counts["mlxvlm_stored_response_bytes"] < 1.5 * MiB
