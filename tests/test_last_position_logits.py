"""The family contract's ``last_only``: ``model(..., last_only=True)`` gives the logits
of the last position alone (the output head applied to it only), equal to the last row of
the full logits, for every family, in a fresh pass and through a cache that already
holds part of the prompt. The generate loop relies on it: its last prefill chunk gives
the first token in the same pass (the greedy parity tests of each family run the loop)."""

from __future__ import annotations

import numpy as np
import pytest
from parity import embedded, user
from tiny import make_image

from mlxvlm import load
from mlxvlm.models.layers import mlx_lm_backbone

FAMILIES = [
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_omni", "gemma3",
    "idefics3", "smolvlm", "llava", "llava_next", "llava_onevision", "pixtral", "mistral3",
    "paligemma", "qwen3_5", "qwen3_5_moe", "lfm2_vl", "paddleocr_vl",
    "qwen3_omni_moe", "gemma4", "gemma4_moe", "gemma3n", "internvl", "internvl3", "internvl_moe",
    "minicpmv4_6",
    "minicpm_ocr",
]
MESSAGES = user(None, "Describe this image.")
IMAGES = [make_image(112, 84, seed=1)]


@pytest.mark.parametrize("family", FAMILIES)
def test_last_only_logits_are_the_last_row_of_the_full_logits(family, tiny_checkpoints):
    model, processor = load(tiny_checkpoints.path(family, "transformers"))
    input_ids, embeddings, state = embedded(model, processor, MESSAGES, IMAGES)
    full = np.array(model(input_ids, model.make_cache(), embeddings=embeddings, state=state))
    last = np.array(
        model(input_ids, model.make_cache(), embeddings=embeddings, state=state, last_only=True)
    )
    assert full.shape[:2] == (1, input_ids.shape[1]) and last.shape == (1, 1, full.shape[2])
    np.testing.assert_allclose(last[0, 0], full[0, -1], rtol=1e-5, atol=1e-5)

    # The same through a cache that holds the prompt but its last 3 tokens (a later
    # prefill chunk), where the prompt has no bidirectional span across that cut.
    cut = input_ids.shape[1] - 3
    if any(start < cut < end for start, end in model.bidirectional_spans(state)):
        return
    cache = model.make_cache()
    model(input_ids[:, :cut], cache, embeddings=embeddings[:, :cut], state=state)
    rest = model(
        input_ids[:, cut:], cache, embeddings=embeddings[:, cut:], state=state, last_only=True
    )
    rest = np.array(rest)
    np.testing.assert_allclose(rest[0, 0], full[0, -1], rtol=1e-4, atol=1e-4)


def test_an_unlisted_mlx_lm_decoder_gets_its_full_logits_sliced(tiny_checkpoints, monkeypatch):
    """A text model whose head mlxvlm does not know to split keeps mlx-lm's own call (the
    same numbers, without the saving)."""
    model, processor = load(tiny_checkpoints.path("llava", "transformers"))
    input_ids, embeddings, state = embedded(model, processor, MESSAGES, IMAGES)
    fast = np.array(model(input_ids, model.make_cache(), embeddings=embeddings, last_only=True))
    monkeypatch.setattr(mlx_lm_backbone, "HEAD_AFTER_DECODER", frozenset())
    calls = []
    original = type(model.language_model).__call__
    monkeypatch.setattr(
        type(model.language_model), "__call__",
        lambda self, *a, **k: calls.append(1) or original(self, *a, **k),
    )
    sliced = np.array(model(input_ids, model.make_cache(), embeddings=embeddings, last_only=True))
    assert calls and sliced.shape == fast.shape == (1, 1, sliced.shape[2])
    np.testing.assert_allclose(sliced, fast, rtol=1e-5, atol=1e-5)
