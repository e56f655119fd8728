"""The CPU fast paths for exp-based functions and attention compute what MLX computes.

- ``fast_math``: exp, GELU (tanh form), quick GELU and SiLU against MLX's functions, in
  value and in gradient; NaN and overflow behaviour; the slicing of large arrays.
- ``attention``: the blocked CPU attention (the C++ kernel of ``mlxvlm.cpu.kernels``, and the
  MLX composition used without it) against ``mx.fast.scaled_dot_product_attention``
  for every mask kind the families pass (none, causal with a cache offset, boolean with
  fully masked rows, additive), grouped-query attention, gradients, threads.
- Whole models with the thresholds lowered so that the tiny checkpoints take every fast
  path: logits within float32 tolerance of ``MLXVLM_NO_CPU_FAST_PATHS=1`` and the same
  greedy tokens; and the opt-out really takes MLX's kernels.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from parity import first_logits_and_greedy_tokens
from tiny import make_image
from mlxvlm import load
from mlxvlm.cpu import attention, fast_math, kernels, policy


def _rel_error(fast: mx.array, reference: np.ndarray) -> float:
    fast = np.array(fast, dtype=np.float64)
    ok = np.abs(reference) > 1e-30
    return float(np.max(np.abs(fast[ok] - reference[ok]) / np.abs(reference[ok])))


def test_exp_matches_float64_as_closely_as_mx_exp():
    x = mx.array(np.linspace(-87.0, 88.0, 200_001, dtype=np.float32))
    reference = np.exp(np.array(x, dtype=np.float64))
    assert policy.fast_math_applies(x)
    fast_error = _rel_error(fast_math.exp(x), reference)
    mlx_error = _rel_error(mx.exp(x), reference)
    assert fast_error < 5e-6, fast_error  # x * log2(e) in float32 sets this floor
    assert fast_error <= mlx_error * 1.5, (fast_error, mlx_error)


def test_exp_edges():
    x = mx.array([float("nan"), -1000.0, -89.0, 0.0, 1.0, 1000.0], dtype=mx.float32)
    out = np.array(fast_math.exp(x))
    assert np.isnan(out[0])
    assert out[1] == 0.0 and out[2] == 0.0  # underflow to zero, as mx.exp does below -88
    assert out[3] == 1.0
    assert abs(out[4] - np.e) < 1e-6
    assert out[5] > 1e38  # inf (C++ kernel) or saturated (MLX composition)


@pytest.mark.parametrize(
    "fast,reference",
    [
        (fast_math.gelu_tanh, nn.gelu_approx),
        (fast_math.quick_gelu, nn.gelu_fast_approx),
        (fast_math.silu, nn.silu),
    ],
    ids=["gelu_tanh", "quick_gelu", "silu"],
)
def test_activations_match_mlx_in_value_and_gradient(fast, reference, monkeypatch):
    monkeypatch.setattr(fast_math, "SLICE_ELEMENTS", 4096)  # also exercise the slicing
    x = mx.random.normal((37, 301), key=mx.random.key(0)) * 6
    assert x.size < fast_math.MIN_ELEMENTS  # small arrays: MLX's own kernel
    assert mx.array_equal(fast(x), reference(x))
    monkeypatch.setattr(fast_math, "MIN_ELEMENTS", 0)
    x = mx.concatenate([x, mx.array([[-100.0, -20.0, 0.0, 20.0, 100.0] + [0.0] * 296])])
    got, want = fast(x), reference(x)
    assert got.shape == want.shape and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-6, atol=2e-6)
    grad_fast = mx.grad(lambda v: (fast(v) * v).sum())(x)
    grad_reference = mx.grad(lambda v: (reference(v) * v).sum())(x)
    np.testing.assert_allclose(np.array(grad_fast), np.array(grad_reference), rtol=1e-5, atol=1e-5)


_SILU_GATED = fast_math.gated(fast_math.silu)


def test_logsumexp_matches_float64_and_mlx_at_the_edges():
    """A sampling step's normalization over a vocabulary-wide row: float64's value, and
    MLX's logsumexp where a row is all -inf (a grammar that allows nothing), holds +inf
    or NaN; MLX's gradient."""
    x = mx.random.normal((3, 49280), key=mx.random.key(3)) * 8
    mx.eval(x)
    values = np.array(x, np.float64)
    top = values.max(axis=-1, keepdims=True)
    want = np.log(np.exp(values - top).sum(axis=-1, keepdims=True)) + top
    got = fast_math.logsumexp_last(x)
    assert got.shape == (3, 1) and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6)
    inf, nan = float("inf"), float("nan")
    edges = mx.array([[-inf, -inf, -inf], [0.0, inf, 1.0], [0.0, nan, 1.0], [-inf, 0.0, -inf],
                      [-1e30, 1e30, 0.0]])
    np.testing.assert_array_equal(np.array(fast_math.logsumexp_last(edges)),
                                  np.array(mx.logsumexp(edges, axis=-1, keepdims=True)))
    small = x[:, :300]
    grad = mx.grad(lambda v: (fast_math.logsumexp_last(v) ** 2).sum())(small)
    want_grad = mx.grad(lambda v: (mx.logsumexp(v, axis=-1, keepdims=True) ** 2).sum())(small)
    np.testing.assert_allclose(np.array(grad), np.array(want_grad), rtol=1e-5, atol=1e-7)


def test_gated_activation_takes_the_kernel_at_decode_sizes(monkeypatch):
    """A decode step's gated MLP (8 rows of 1536: under MIN_ELEMENTS) through mlxvlm's
    vectorised kernel, not MLX's compiled one (scalar exponentials), with MLX's values."""
    gate, up = (mx.random.normal((8, 1536), key=mx.random.key(i)) * 4 for i in (1, 2))
    assert gate.size < fast_math.MIN_ELEMENTS
    calls = []
    original = kernels.activation
    monkeypatch.setattr(kernels, "activation",
                        lambda *a, **k: calls.append(a[1]) or original(*a, **k))
    got = _SILU_GATED(gate, up)
    assert calls == ["silu"]
    np.testing.assert_allclose(np.array(got), np.array(nn.silu(gate) * up), rtol=2e-6, atol=2e-6)




@pytest.mark.parametrize(
    "fast,reference,arity",
    [
        (fast_math.gelu_tanh, nn.gelu_approx, 1),
        (fast_math.quick_gelu, nn.gelu_fast_approx, 1),
        (fast_math.silu, nn.silu, 1),
        (fast_math.exp, mx.exp, 1),
        (_SILU_GATED, lambda gate, up: nn.silu(gate) * up, 2),
    ],
    ids=["gelu_tanh", "quick_gelu", "silu", "exp", "gated_silu"],
)
def test_fast_activations_write_over_a_temporary_input(fast, reference, arity):
    """What the layers call (a tower MLP's activation of its first product's output)
    writes over that output's buffer when nothing else holds it: one 1024 x 3072 buffer,
    not two (12.6 MB less at a SigLIP layer's peak). Derivatives stay MLX's."""
    inputs = [mx.random.normal((1024, 3072), key=mx.random.key(i)) for i in range(arity)]
    mx.eval(inputs)
    want = reference(*inputs)
    mx.eval(want)
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    out = fast(inputs[0] * 1.0, *inputs[1:])  # the product is held by nothing else
    mx.eval(out)
    assert mx.get_peak_memory() - start < 1.5 * inputs[0].nbytes
    np.testing.assert_allclose(np.array(out), np.array(want), rtol=2e-5, atol=2e-6)
    small = [x[:64, :300] * 2 for x in inputs]
    grads = mx.grad(lambda *a: (fast(*a) * a[0]).sum(), argnums=tuple(range(arity)))(*small)
    want_grads = mx.grad(lambda *a: (reference(*a) * a[0]).sum(),
                         argnums=tuple(range(arity)))(*small)
    for got, expected in zip(grads, want_grads):
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-5)


def test_half_precision_and_opt_out_take_mlx_functions(monkeypatch):
    x = mx.random.normal((256, 256), key=mx.random.key(1))
    assert not mx.array_equal(fast_math.gelu_tanh(x), nn.gelu_approx(x))  # fast path taken
    assert not policy.fast_math_applies(x.astype(mx.bfloat16))
    monkeypatch.setenv(policy.NO_FAST_PATHS_ENV, "1")
    assert not policy.fast_math_applies(x)
    assert mx.array_equal(fast_math.gelu_tanh(x), nn.gelu_approx(x))
    assert mx.array_equal(fast_math.exp(x), mx.exp(x))


def test_in_slices_keeps_shape_and_order(monkeypatch):
    monkeypatch.setattr(fast_math, "SLICE_ELEMENTS", 100)
    x = mx.arange(3 * 7 * 11, dtype=mx.float32).reshape(3, 7, 11)
    assert mx.array_equal(fast_math.in_slices(lambda t: t * 2, x), x * 2)


def test_max_last_axis():
    x = mx.random.normal((3, 5, 1024), key=mx.random.key(2))
    assert mx.array_equal(fast_math.max_last_axis(x), x.max(axis=-1, keepdims=True))
    odd = x[..., :1000]
    assert mx.array_equal(fast_math.max_last_axis(odd), odd.max(axis=-1, keepdims=True))


@pytest.fixture(params=["kernel", "mlx"])
def attention_path(request, monkeypatch):
    """Runs the test on the C++ attention kernel and on the MLX composition used where the
    kernels cannot be built; returns the list its calls are counted in."""
    calls = []
    if request.param == "mlx":
        monkeypatch.setenv(policy.NO_KERNELS_ENV, "1")
        name, module = "_blocked_attention", attention
    else:
        assert kernels.enabled(), kernels.describe()
        name, module = "attention", kernels
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


def _qkv(batch, heads, kv_heads, queries, keys, dims=32, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((batch, heads, queries, dims), key=k1) * 2
    k = mx.random.normal((batch, kv_heads, keys, dims), key=k2) * 2
    v = mx.random.normal((batch, kv_heads, keys, dims), key=k3)
    return q, k, v


def _masks(batch, heads, queries, keys):
    key = mx.random.key(3)
    boolean = mx.random.uniform(shape=(batch, 1, queries, keys), key=key) > 0.4
    boolean[:, :, 5, :] = False  # a query that sees no key at all
    return {
        "none": None,
        "causal": "causal",
        "boolean": boolean,
        "keys_only": mx.arange(keys)[None, None, None] < keys - 9,
        "additive": mx.random.normal((batch, heads, queries, keys), key=key),
    }


def _float64_attention(q, k, v, scale, mask):
    q, k, v = (np.array(t, dtype=np.float64) for t in (q, k, v))
    repeats = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, repeats, axis=1), np.repeat(v, repeats, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * scale
    if isinstance(mask, str):
        queries, keys = scores.shape[-2:]
        visible = np.arange(queries)[:, None] + (keys - queries) >= np.arange(keys)[None]
        scores = np.where(visible, scores, -np.inf)
    elif mask is not None and mask.dtype == mx.bool_:
        scores = np.where(np.array(mask), scores, -np.inf)
    elif mask is not None:
        scores = scores + np.array(mask, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return (weights / weights.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("mask_kind", ["none", "causal", "boolean", "keys_only", "additive"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_blocked_attention_matches_mlx(mask_kind, heads, kv_heads, attention_path, monkeypatch):
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    monkeypatch.setattr(attention, "BLOCK_SCORES", 4000)  # many blocks, a ragged last one
    batch, queries, keys = 2, 45, 70  # queries < keys: a cache offset for "causal"
    q, k, v = _qkv(batch, heads, kv_heads, queries, keys)
    mask = _masks(batch, heads, queries, keys)[mask_kind]
    got = attention.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    assert attention_path
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    truth = _float64_attention(q, k, v, 0.3, mask)
    got, want = np.array(got, dtype=np.float64), np.array(want, dtype=np.float64)
    if mask_kind == "boolean":  # MLX leaves a query with no visible key undefined (NaN)
        got, want, truth = got[:, :, 6:], want[:, :, 6:], truth[:, :, 6:]
    # As close to the float64 result as MLX's own kernel is (scores reach ~30 here, so
    # float32 rounding of the scores moves the weights by a few 1e-6).
    mlx_error = np.abs(want - truth).max()
    assert np.abs(got - truth).max() <= 2 * mlx_error + 1e-6, (np.abs(got - truth).max(), mlx_error)


def _float64_causal_attention(q, k, v, scale):
    """Causal attention as MLX operations in float64 (differentiable), grouped heads
    repeated: the reference the float32 gradients are measured against."""
    q, k, v = (t.astype(mx.float64) for t in (q, k, v))
    repeats = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, repeats, axis=1), mx.repeat(v, repeats, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    queries, keys = scores.shape[-2:]
    visible = mx.arange(keys)[None] <= mx.arange(queries)[:, None] + (keys - queries)
    scores = mx.where(visible, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ v


def test_blocked_attention_gradients_are_mlx_gradients(attention_path, monkeypatch):
    """The gradients are as close to the float64 ones as MLX's own kernel's are."""
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    monkeypatch.setattr(attention, "BLOCK_SCORES", 2000)
    q, k, v = _qkv(1, 4, 2, 30, 30)

    def loss(function):
        return lambda q, k, v: (function(q, k, v, scale=0.2, mask="causal") ** 2).sum()

    fast = mx.grad(loss(attention.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    assert attention_path
    want = mx.grad(loss(mx.fast.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    truth = mx.grad(lambda q, k, v: (_float64_causal_attention(q, k, v, 0.2) ** 2).sum(),
                    argnums=(0, 1, 2))(q, k, v)
    for got, mlx_grad, exact in zip(fast, want, truth):
        exact = np.array(exact)
        error, mlx_error = (np.abs(np.array(g, dtype=np.float64) - exact).max()
                            for g in (got, mlx_grad))
        assert mlx_error < 1e-4  # the reference is right
        assert error <= 2 * mlx_error + 1e-6, (error, mlx_error)


def test_small_problems_and_opt_out_take_mlx_kernel(monkeypatch):
    q, k, v = _qkv(1, 4, 4, 50, 50)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3)
    # The C++ kernel takes every size (a decoding step's attention is one operation).
    kernel = attention.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert not mx.array_equal(kernel, want)
    np.testing.assert_allclose(np.array(kernel), np.array(want), rtol=1e-5, atol=1e-5)
    # Without it, below MIN_SCORES: exactly MLX's result, since the MLX composition is
    # slower than MLX's own kernel there.
    monkeypatch.setenv(policy.NO_KERNELS_ENV, "1")
    assert mx.array_equal(attention.scaled_dot_product_attention(q, k, v, scale=0.3), want)
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    assert not mx.array_equal(attention.scaled_dot_product_attention(q, k, v, scale=0.3), want)
    monkeypatch.setenv(policy.NO_FAST_PATHS_ENV, "1")
    assert mx.array_equal(attention.scaled_dot_product_attention(q, k, v, scale=0.3), want)


def test_blocked_attention_on_another_thread(attention_path, monkeypatch):
    """Models load on one thread and generate on another (the server does)."""
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    monkeypatch.setattr(attention, "BLOCK_SCORES", 3000)
    q, k, v = _qkv(1, 4, 4, 40, 40)
    want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3))
    results = []

    def work():
        out = attention.scaled_dot_product_attention(q, k, v, scale=0.3)
        results.append(np.array(out))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and len(attention_path) == 2
    for r in results:
        np.testing.assert_allclose(r, want, rtol=1e-5, atol=5e-6)


IMAGE = make_image(112, 84, seed=4)
PROMPT = "Describe this image."


def _logits_and_tokens(path):
    model, processor = load(path)
    return first_logits_and_greedy_tokens(model, processor, PROMPT, IMAGE, max_tokens=16)


@pytest.mark.parametrize(
    "family", ["idefics3", "qwen2_vl", "qwen2_5_vl", "gemma3", "pixtral", "llava_onevision"]
)
def test_models_on_fast_paths_match_standard_path(tiny_checkpoints, family, attention_path,
                                                  monkeypatch):
    """Every attention and activation of the tiny model on the fast paths (thresholds
    lowered): the same logits within float32 tolerance and the same greedy tokens."""
    path = tiny_checkpoints.path(family, "hub")
    monkeypatch.setenv(policy.NO_FAST_PATHS_ENV, "1")
    standard_logits, standard_tokens = _logits_and_tokens(path)
    monkeypatch.delenv(policy.NO_FAST_PATHS_ENV)
    assert not attention_path
    calls = attention_path
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    monkeypatch.setattr(attention, "BLOCK_SCORES", 2000)
    monkeypatch.setattr(fast_math, "SLICE_ELEMENTS", 2000)
    monkeypatch.setattr(fast_math, "MIN_ELEMENTS", 0)
    fast_logits, fast_tokens = _logits_and_tokens(path)
    assert calls, "the fast attention path was not taken"
    np.testing.assert_allclose(fast_logits, standard_logits, rtol=1e-4, atol=1e-4)
    assert fast_tokens == standard_tokens


@pytest.mark.parametrize("family,kind", [("idefics3", "llama"), ("gemma3", "gemma3_text"),
                                         ("llava", "llama")])
def test_mlx_lm_mlps_get_fast_activations_with_the_same_parameters(tiny_checkpoints, family,
                                                                   kind, attention_path,
                                                                   monkeypatch):
    from mlx.utils import tree_flatten

    from mlxvlm.cpu.mlx_lm import GatedMLP, use_fast_attention

    path = tiny_checkpoints.path(family, "hub")
    monkeypatch.setenv(policy.NO_FAST_PATHS_ENV, "1")
    standard, _ = load(path)
    monkeypatch.delenv(policy.NO_FAST_PATHS_ENV)
    fast, _ = load(path)
    mlps = [m for _, m in fast.named_modules() if isinstance(m, GatedMLP)]
    assert mlps and fast.cpu_fast_paths.fast_mlps == len(mlps)
    assert not any(isinstance(m, GatedMLP) for _, m in standard.named_modules())
    assert f"mlx_lm.models.{kind}" in use_fast_attention(fast)
    # The text model's attention layers now take the blocked path...
    calls = attention_path
    calls.clear()
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    ids = mx.array([[1, 2, 3, 4, 5, 6]])
    out = fast(ids, fast.make_cache())
    assert len(calls) == len(fast.layers)
    # ...and compute what the standard model computes on MLX's kernels.
    monkeypatch.setenv(policy.NO_FAST_PATHS_ENV, "1")
    want = standard(ids, standard.make_cache())
    assert len(calls) == len(fast.layers)
    np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-4, atol=1e-4)
    assert sorted(k for k, _ in tree_flatten(fast.parameters())) == sorted(
        k for k, _ in tree_flatten(standard.parameters())
    )
