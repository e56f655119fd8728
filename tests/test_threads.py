"""A model loaded on one thread generates on another (the server's engine thread, the chat
UI's workers): nothing the families build at load may stay a lazy computation tied to the
loading thread's MLX stream."""

from __future__ import annotations

import threading

import pytest

from mlxvlm import generate, load
from tiny import GENERATIVE, make_image

@pytest.mark.parametrize("family", sorted(GENERATIVE))
def test_generate_on_another_thread(tiny_checkpoints, family):
    model, processor = load(tiny_checkpoints.path(family, "hub"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    image = make_image(64, 48, seed=1)
    outcome = {}

    def run():
        try:
            outcome["tokens"] = generate(model, processor, messages, [image], max_tokens=3).tokens
        except Exception as exc:  # reported below, with the family
            outcome["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=300)
    assert "error" not in outcome, f"{family}: {outcome.get('error')!r}"
    assert len(outcome["tokens"]) >= 1
