"""How many operations a decoding step is on MLX's CPU backend.

A decoding step's arithmetic is small (one row through each layer); its cost beyond
reading the weights is MLX's dispatch, ~10 us per operation. MLX composes RoPE, RMSNorm
and attention from ~20, ~12 and ~8 operations on the CPU; mlxvlm's kernels make each one
(``mlxvlm.cpu.rope``, ``mlxvlm.cpu.norms``, ``mlxvlm.cpu.attention``). This
counts the operations of one step's graph (MLX's ``export_to_dot``) with and without the
kernels, on tiny checkpoints: mlx-lm's decoders and Qwen2-VL's M-RoPE decoder."""

from __future__ import annotations

import collections
import re

import mlx.core as mx
import numpy as np
import pytest

from mlxvlm import load
from mlxvlm.cpu import kernels, policy

# family: (its rotary kernel, the most operations a step keeps of those without the
# kernels). mlx-lm's decoders rotate from positions; Qwen2-VL's M-RoPE decoder from its
# own cos/sin tables, computed once a step and shared by its layers (MLX's composition
# of the rotation itself was 7 operations a layer, not ~20).
FAMILIES = {"idefics3": ("MlxvlmRoPE", 0.4), "llava": ("MlxvlmRoPE", 0.4),
            "gemma3": ("MlxvlmRoPE", 0.4), "qwen2_vl": ("MlxvlmRotary", 0.6)}


def _step_operations(model, tmp_path) -> collections.Counter:
    """The operations of one decoding step's graph, by primitive name."""
    ids = mx.array([[5, 6, 7, 8, 9, 10, 11, 12]])
    cache = model.make_cache()
    embeddings, state = model.embed(ids)
    mx.eval(model(ids, cache, embeddings=embeddings, state=state, last_only=True))
    logits = model(mx.array([[13]]), cache, state=state, last_only=True)
    dot = tmp_path / "step.dot"
    written = [a for c in cache for a in c.state if isinstance(a, mx.array)]
    mx.export_to_dot(str(dot), logits, *written)
    mx.eval(logits)
    # Operations are drawn as rectangles (arrays as ovals), labelled with their primitive.
    return collections.Counter(re.findall(r'label ?="?(\w+)"?, shape=rectangle', dot.read_text()))


# What MLX's compositions of RoPE (cos, sin per layer; rotate_half's negation), RMSNorm
# (square, rsqrt) and attention (softmax) leave in a graph; none of it is left with the
# kernels.
COMPOSED = {"MlxvlmRoPE": {"Cos", "Sin", "Square", "Rsqrt", "Softmax"},
            "MlxvlmRotary": {"Negative", "Square", "Rsqrt", "Softmax"}}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_decoding_step_has_a_third_of_mlxs_operations(family, tiny_checkpoints, tmp_path,
                                                        monkeypatch):
    path = tiny_checkpoints.path(family, "hub")
    model, _ = load(path)
    with_kernels = _step_operations(model, tmp_path)
    monkeypatch.setenv(policy.NO_KERNELS_ENV, "1")
    reference, _ = load(path)
    without = _step_operations(reference, tmp_path)
    rotary, kept = FAMILIES[family]
    assert COMPOSED[rotary] <= set(without), without
    assert not COMPOSED[rotary] & set(with_kernels), with_kernels
    for kernel in (rotary, "MlxvlmNorm", "MlxvlmAttention"):
        assert with_kernels[kernel] > 0, with_kernels
    # SmolVLM-256M (bf16): ~3,400 operations a step without the kernels, ~850 with;
    # Qwen2-VL-2B ~1,400 and ~800. These tiny float32 checkpoints keep MLX's linear layers
    # (3-4 operations each) both ways, hence larger ratios.
    total, reference_total = sum(with_kernels.values()), sum(without.values())
    assert total <= kept * reference_total, (total, reference_total)


def test_the_kernels_step_gives_the_same_logits(tiny_checkpoints, monkeypatch):
    path = tiny_checkpoints.path("idefics3", "hub")
    ids = mx.array([[5, 6, 7, 8, 9, 10, 11, 12]])

    def step_logits():
        model, _ = load(path)
        cache = model.make_cache()
        embeddings, state = model.embed(ids)
        model(ids, cache, embeddings=embeddings, state=state, last_only=True)
        return np.array(model(mx.array([[13]]), cache, state=state, last_only=True))

    got = step_logits()
    monkeypatch.setenv(policy.NO_KERNELS_ENV, "1")
    np.testing.assert_allclose(got, step_logits(), rtol=1e-4, atol=1e-4)
