"""mlxvlm's CPU kernels (mlxvlm/cpu/kernels) compute what MLX computes, and models use them.

- ``half_linear``: float32 input times a bfloat16/float16 weight against the float64
  product of the same weights, for decode-sized (gemv) and prefill-sized inputs, with
  MLX's gradients, forward-mode derivatives and ``mx.compile``.
- ``activation``: GELU (tanh form), quick GELU, SiLU and exp against float64, at the edges
  (NaN, +-inf, overflow) as MLX's functions, gated and not.
- ``attention``: every models' head size and odd ones, lengths that are not multiples of
  the tiles and blocks, causal with and without a cache offset, masks broadcast every
  way, rows that see no key (NaN), strided (transposed) inputs, a copy for non-unit
  column strides; on this CPU's instruction set and, capped by ``MLXVLM_CPU_ISA``, on the
  narrower ones (AVX2, portable).
- bf16 checkpoints keep their linear/embedding weights in bf16 and give the logits and
  greedy tokens of the float32-weight path; a 4-bit decoder next to a bf16 tower; LoRA
  wraps the layers; ``MLXVLM_NO_CPU_KERNELS=1`` and a machine without a
  compiler fall back to float32 weights.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from tiny import make_image
from user_environment import user_environment
from mlxvlm.cpu import kernels, policy
from mlxvlm.cpu.half_weights import CPUHalfEmbedding, CPUHalfLinear, residual_plus
from mlxvlm.cpu.quantized import CPUKernelQuantizedEmbedding, CPUKernelQuantizedLinear


def test_the_kernels_build_and_load_here():
    assert kernels.enabled(), kernels.describe()
    assert "kernels" in kernels.describe()


# ------------------------------------------------------------------------- half_linear


def _float64_product(x: mx.array, w: mx.array) -> np.ndarray:
    return np.array(x, dtype=np.float64) @ np.array(w.astype(mx.float32), dtype=np.float64).T


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 151])
def test_half_linear_matches_the_float64_product(dtype, rows):
    k1, k2 = mx.random.split(mx.random.key(rows), 2)
    x = mx.random.normal((rows, 203), key=k1)  # 203: not a multiple of the 8-float lanes
    w = (mx.random.normal((67, 203), key=k2) * 0.2).astype(dtype)
    got = kernels.half_linear(x, w)
    assert got.dtype == mx.float32 and got.shape == (rows, 67)
    want = _float64_product(x, w)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
def test_half_linear_gives_each_row_of_a_batch_what_it_gives_the_row_alone(dtype):
    """Up to 8 rows (a batched decode step's sequences) share one pass over the weights,
    each row's sums taken in the order of a row alone: bit for bit the same products, so
    a sequence decodes the same in a batch as alone. Every register tile's tail: 67
    outputs (odd: the one-weight-row tile after the multi-row ones), 203 columns (past the
    last 16- and 8-float vector); a bias and a residual as the decoders add them."""
    keys = mx.random.split(mx.random.key(7), 4)
    x = mx.random.normal((8, 203), key=keys[0])
    w = (mx.random.normal((67, 203), key=keys[1]) * 0.2).astype(dtype)
    bias = mx.random.normal((67,), key=keys[2])
    residual = mx.random.normal((8, 67), key=keys[3])
    mx.eval(x, w, bias, residual)
    alone = np.concatenate([np.array(kernels.half_linear(x[i : i + 1], w, bias, residual[i : i + 1]))
                            for i in range(8)])
    want = _float64_product(x, w) + np.array(bias, np.float64) + np.array(residual, np.float64)
    np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for rows in range(2, 9):
        together = np.array(kernels.half_linear(x[:rows], w, bias, residual[:rows]))
        np.testing.assert_array_equal(together, alone[:rows])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rows,K,N", [(9, 16, 1), (145, 161, 33), (300, 700, 1000),
                                     (13, 48, 1700)],
                         ids=["one_column", "block_edges", "many_blocks", "column_blocks"])
def test_half_linear_prefill_blocks_and_edges(dtype, rows, K, N):
    """Prefill's products over several depth slices (160), row blocks (144), column
    blocks (768 per thread) and 12 x 32 register tiles, with ragged edges on every side
    and the output columns split over the threads; with a bias and a residual added, as
    the towers' layers add them."""
    k1, k2, k3, k4 = mx.random.split(mx.random.key(rows + K + N), 4)
    x = mx.random.normal((rows, K), key=k1)
    w = (mx.random.normal((N, K), key=k2) * 0.2).astype(dtype)
    bias = mx.random.normal((N,), key=k3)
    residual = mx.random.normal((rows, N), key=k4)
    mx.eval(x, w, bias, residual)
    product = _float64_product(x, w)
    scale = np.abs(product).max()
    np.testing.assert_allclose(np.array(kernels.half_linear(x, w)), product,
                               rtol=1e-5, atol=1e-5 * scale)
    want = product + np.array(bias, dtype=np.float64) + np.array(residual, dtype=np.float64)
    got = kernels.half_linear(x, w, bias, residual)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("rows", [1, 151])
def test_half_linear_adds_the_bias(rows):
    x = mx.random.normal((rows, 40), key=mx.random.key(20))
    w = mx.random.normal((33, 40), key=mx.random.key(21)).astype(mx.bfloat16)
    bias = mx.random.normal((33,), key=mx.random.key(22))
    want = _float64_product(x, w) + np.array(bias, dtype=np.float64)
    np.testing.assert_allclose(np.array(kernels.half_linear(x, w, bias)), want,
                               rtol=1e-5, atol=1e-5)
    grads = mx.grad(lambda b: (kernels.half_linear(x, w, b) ** 2).sum())(bias)
    want_grads = mx.grad(lambda b: ((x @ w.astype(mx.float32).T + b) ** 2).sum())(bias)
    np.testing.assert_allclose(np.array(grads), np.array(want_grads), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="bias"):
        kernels.half_linear(x, w, mx.zeros((32,)))


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 151])
def test_half_linear_adds_a_residual_in_its_product(rows, with_bias):
    """residual + x W^T (+ b): rows <= 8 on the gemv, more through the prefill GEMM, where
    the output may take over the residual's buffer (a residual nothing else holds:
    ``fresh``)."""
    keys = mx.random.split(mx.random.key(rows + 100 * with_bias), 4)
    x = mx.random.normal((2, rows, 40), key=keys[0])
    w = mx.random.normal((33, 40), key=keys[1]).astype(mx.bfloat16)
    bias = mx.random.normal((33,), key=keys[2]) if with_bias else None
    residual = mx.random.normal((2, rows, 33), key=keys[3])
    mx.eval(residual)
    want = (np.array(residual, dtype=np.float64)
            + np.array(x, dtype=np.float64) @ np.array(w.astype(mx.float32), dtype=np.float64).T
            + (np.array(bias, dtype=np.float64) if with_bias else 0.0))
    kept = kernels.half_linear(x, w, bias, residual)
    fresh = kernels.half_linear(x, w, bias, residual * 1.0)
    for got in (kept, fresh):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    # The residual the caller still holds is left as it was.
    np.testing.assert_array_equal(np.array(residual), np.array(residual * 1.0))
    with pytest.raises(ValueError, match="residual"):
        kernels.half_linear(x, w, bias, residual[..., :5])


def test_half_linear_residual_derivatives_are_the_float32_layers():
    keys = mx.random.split(mx.random.key(8), 5)
    x = mx.random.normal((7, 24), key=keys[0])
    w = mx.random.normal((10, 24), key=keys[1]).astype(mx.bfloat16)
    bias = mx.random.normal((10,), key=keys[2])
    residual = mx.random.normal((7, 10), key=keys[3])
    cotangent = mx.random.normal((7, 10), key=keys[4])

    def reference(x, bias, residual):
        return residual + x @ w.astype(mx.float32).T + bias

    def kernel(x, bias, residual):
        return kernels.half_linear(x, w, bias, residual)

    primals = [x, bias, residual]
    _, got = mx.vjp(kernel, primals, [cotangent])
    _, want = mx.vjp(reference, primals, [cotangent])
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(r), rtol=1e-5, atol=1e-5)
    tangents = [mx.random.normal(p.shape, key=mx.random.key(30 + i)) for i, p in enumerate(primals)]
    _, (jvp,) = mx.jvp(kernel, primals, tangents)
    _, (want_jvp,) = mx.jvp(reference, primals, tangents)
    np.testing.assert_allclose(np.array(jvp), np.array(want_jvp), rtol=1e-4, atol=1e-4)


def test_residual_plus_uses_the_layer_product_where_it_can():
    """``residual_plus`` sums in the 16-bit layer's product and falls back to MLX's
    addition for any other layer, with the same result."""
    x = mx.random.normal((9, 16), key=mx.random.key(40))
    residual = mx.random.normal((9, 12), key=mx.random.key(41))
    plain = nn.Linear(16, 12)
    half = nn.Linear(16, 12)
    half.update({"weight": plain.weight.astype(mx.bfloat16), "bias": plain.bias})
    half = CPUHalfLinear(half)
    mx.eval(x, residual, plain.parameters(), half.parameters())
    want = residual + x @ plain.weight.astype(mx.bfloat16).astype(mx.float32).T + plain.bias
    got = residual_plus(residual, half, x)
    assert "MlxvlmHalfLinear" in graph_operations(got) and "Add" not in graph_operations(got)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(residual_plus(residual, plain, x)),
                               np.array(residual + plain(x)), rtol=1e-6, atol=1e-6)


def test_a_half_linear_whose_weight_its_model_rewrote_computes_as_nn_linear():
    """mlx-lm's Gemma 3n AltUp sets its coefficient layers' weights to float32 copies on
    every call: such a layer computes as ``nn.Linear`` with the new weight (the kernel
    takes only 16-bit ones), product and residual sum alike."""
    x = mx.random.normal((3, 4), key=mx.random.key(42))
    residual = mx.random.normal((3, 16), key=mx.random.key(43))
    layer = nn.Linear(4, 16, bias=False)
    layer.weight = layer.weight.astype(mx.bfloat16)
    half = CPUHalfLinear(layer)
    half.weight = mx.clip(half.weight.astype(mx.float32), -0.1, 0.1)  # as AltUp does
    want = x @ half.weight.T
    np.testing.assert_array_equal(np.array(half(x)), np.array(want))
    np.testing.assert_array_equal(np.array(residual_plus(residual, half, x)),
                                  np.array(residual + want))


def test_vit_blocks_add_their_residuals_inside_16_bit_products():
    """A SigLIP/CLIP block with 16-bit weights: its two residual additions happen in the
    out and fc2 products (two MLX additions fewer), with the unfused block's result."""
    from types import SimpleNamespace

    from mlxvlm.cpu.half_weights import use_half_weight_layers
    from mlxvlm.models.layers.vit import EncoderLayer

    config = SimpleNamespace(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                             num_hidden_layers=1, hidden_act="gelu_pytorch_tanh",
                             layer_norm_eps=1e-6)
    layer = EncoderLayer(config)
    layer.update(tree_map(lambda p: p.astype(mx.bfloat16) if p.ndim == 2 else p,
                          layer.parameters()))
    assert use_half_weight_layers(layer)[0] == 6
    x = mx.random.normal((2, 9, 64), key=mx.random.key(50))
    mx.eval(x, layer.parameters())
    fused = layer(x)
    h = x + layer.self_attn(layer.layer_norm1(x))
    unfused = h + layer.mlp(layer.layer_norm2(h))
    assert graph_operations(fused).count("Add") == graph_operations(unfused).count("Add") - 2
    np.testing.assert_allclose(np.array(fused), np.array(unfused), rtol=1e-5, atol=1e-5)


def test_half_linear_takes_any_leading_shape_and_checks_its_arguments():
    x = mx.random.normal((2, 3, 16), key=mx.random.key(1))
    w = mx.random.normal((5, 16), key=mx.random.key(2)).astype(mx.bfloat16)
    np.testing.assert_allclose(np.array(kernels.half_linear(x, w)), _float64_product(x, w),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="last axis"):
        kernels.half_linear(mx.zeros((2, 15)), w)
    with pytest.raises(ValueError, match="bfloat16/float16"):
        kernels.half_linear(x, w.astype(mx.float32))


def test_half_linear_derivatives_are_the_float32_layers():
    x = mx.random.normal((3, 24), key=mx.random.key(3))
    w = mx.random.normal((10, 24), key=mx.random.key(4)).astype(mx.bfloat16)
    cotangent = mx.random.normal((3, 10), key=mx.random.key(5))

    def reference(x, w):
        return x @ w.astype(mx.float32).T

    _, (gx, gw) = mx.vjp(kernels.half_linear, [x, w], [cotangent])
    _, (rx, rw) = mx.vjp(reference, [x, w], [cotangent])
    np.testing.assert_allclose(np.array(gx), np.array(rx), rtol=1e-5, atol=1e-5)
    assert gw.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(gw.astype(mx.float32)),
                               np.array(rw.astype(mx.float32)), rtol=1e-2, atol=1e-2)
    tangents = [mx.random.normal(x.shape, key=mx.random.key(6)),
                mx.random.normal(w.shape, key=mx.random.key(7)).astype(mx.bfloat16)]
    _, (jvp,) = mx.jvp(kernels.half_linear, [x, w], tangents)
    _, (want,) = mx.jvp(reference, [x, w], tangents)
    np.testing.assert_allclose(np.array(jvp), np.array(want), rtol=1e-4, atol=1e-4)
    compiled = mx.compile(lambda x: kernels.half_linear(x, w) * 2.0)
    np.testing.assert_allclose(np.array(compiled(x)), 2 * np.array(reference(x, w)),
                               rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------- activation

_FLOAT64 = {
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x)),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "exp": np.exp,
}
_MLX = {"gelu_tanh": nn.gelu_approx, "quick_gelu": nn.gelu_fast_approx, "silu": nn.silu,
        "exp": mx.exp}


@pytest.mark.parametrize("kind", kernels.ACTIVATIONS)
def test_activation_matches_float64_and_mlx_edges(kind):
    x = mx.array(np.linspace(-30, 30, 100_003, dtype=np.float32))
    with np.errstate(over="ignore"):
        want = _FLOAT64[kind](np.array(x, dtype=np.float64))
    got = np.array(kernels.activation(x, kind), dtype=np.float64)
    scale = np.maximum(np.abs(want), 1e-3)  # relative, absolute near zero crossings
    assert np.max(np.abs(got - want) / scale) < 2e-5
    up = mx.random.normal(x.shape, key=mx.random.key(8))
    np.testing.assert_allclose(np.array(kernels.activation(x, kind, up)),
                               np.array(kernels.activation(x, kind)) * np.array(up),
                               rtol=1e-6, atol=1e-30)
    edges = mx.array([float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 0.0] * 3)
    got_edges, mlx_edges = np.array(kernels.activation(edges, kind)), np.array(_MLX[kind](edges))
    np.testing.assert_array_equal(np.isnan(got_edges), np.isnan(mlx_edges))
    finite = ~np.isnan(mlx_edges)
    np.testing.assert_allclose(got_edges[finite], mlx_edges[finite], rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_activation_takes_over_a_temporary_inputs_buffer(gated):
    """An input that nothing else holds (a product's output inside a layer) lends its
    buffer to the output, as MLX's own element-wise kernels do: one allocation instead of
    two. The values are those computed from an input that is held elsewhere."""
    x = mx.random.normal((1024, 1024), key=mx.random.key(9))
    up = mx.random.normal((1024, 1024), key=mx.random.key(10)) if gated else None
    mx.eval([a for a in (x, up) if a is not None])
    want = np.array(kernels.activation(x, "silu", up))
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    out = kernels.activation(x * 1.0, "silu", up)  # the product is held by nothing else
    mx.eval(out)
    assert mx.get_peak_memory() - start < 1.5 * x.nbytes  # the product's buffer, once
    np.testing.assert_array_equal(np.array(out), want)


def test_activation_rejects_unknown_kinds_and_shapes():
    with pytest.raises(ValueError, match="unknown activation"):
        kernels.activation(mx.zeros(3), "relu")
    with pytest.raises(ValueError, match="shape"):
        kernels.activation(mx.zeros(3), "silu", mx.zeros(4))


# -------------------------------------------------------------------- quantized_linear


def _float64_dequantized_product(x, w, scales, biases, group_size, bits):
    exact = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                          group_size=group_size, bits=bits)
    return np.array(x, dtype=np.float64) @ np.array(exact, dtype=np.float64).T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("rows", [1, 3, 4, 40, 151])
def test_quantized_linear_is_the_dequantized_product(bits, group_size, scale_dtype, rows):
    keys = mx.random.split(mx.random.key(bits * group_size + rows), 3)
    weight = mx.random.normal((72, 256), key=keys[0]).astype(scale_dtype)
    w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    x = mx.random.normal((rows, 256), key=keys[1])
    bias = mx.random.normal((72,), key=keys[2])
    got = kernels.quantized_linear(x, w, scales, biases, group_size=group_size, bits=bits,
                                   bias=bias)
    want = _float64_dequantized_product(x, w, scales, biases, group_size, bits)
    want += np.array(bias, dtype=np.float64)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # MLX's own kernel computes the same product.
    mlx = mx.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits) + bias
    np.testing.assert_allclose(np.array(got), np.array(mlx), rtol=1e-4, atol=1e-4)


def test_quantized_linear_gradient_and_errors():
    w, scales, biases = mx.quantize(mx.random.normal((16, 64), key=mx.random.key(40)), 32, 4)
    x = mx.random.normal((2, 5, 64), key=mx.random.key(41))
    grad = mx.grad(lambda x: kernels.quantized_linear(x, w, scales, biases, group_size=32,
                                                      bits=4).sum())(x)
    want = mx.grad(lambda x: mx.quantized_matmul(x, w, scales, biases, group_size=32,
                                                 bits=4).sum())(x)
    np.testing.assert_allclose(np.array(grad), np.array(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="4- and 8-bit"):
        kernels.quantized_linear(x, w, scales, biases, group_size=32, bits=3)
    with pytest.raises(ValueError, match="last axis"):
        kernels.quantized_linear(mx.zeros((2, 32)), w, scales, biases, group_size=32, bits=4)
    with pytest.raises(ValueError, match="scales"):
        kernels.quantized_linear(x, w, scales[:, :1], biases, group_size=32, bits=4)


def test_quantized_embedding_rows_and_tied_output():
    table = nn.Embedding(50, 64)
    table.weight = table.weight.astype(mx.bfloat16)
    quantized = nn.QuantizedEmbedding.from_embedding(table, group_size=32, bits=4)
    layer = CPUKernelQuantizedEmbedding(quantized)
    ids = mx.array([[3, 7, 49]])
    exact = mx.dequantize(quantized.weight, quantized.scales.astype(mx.float32),
                          quantized.biases.astype(mx.float32), group_size=32, bits=4)
    np.testing.assert_allclose(np.array(layer(ids)), np.array(exact[ids]), rtol=1e-6, atol=1e-6)
    h = mx.random.normal((1, 2, 64), key=mx.random.key(42))
    np.testing.assert_allclose(np.array(layer.as_linear(h)),
                               np.array(h, dtype=np.float64) @ np.array(exact, dtype=np.float64).T,
                               rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------- norm


@pytest.mark.parametrize("affine", ["weight_and_bias", "weight", "none"])
def test_layer_norm_matches_mlx(affine):
    x = mx.random.normal((3, 301, 203), key=mx.random.key(23)) * 3 + 5  # offset: no cancellation
    weight = mx.random.normal((203,), key=mx.random.key(24)) if affine != "none" else None
    bias = mx.random.normal((203,), key=mx.random.key(25)) if affine == "weight_and_bias" else None
    got = kernels.norm(x, weight, bias, eps=1e-6)
    want = mx.fast.layer_norm(x, weight, bias, 1e-6)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_rms_norm_matches_mlx():
    x = mx.random.normal((2, 77, 576), key=mx.random.key(26))
    weight = mx.random.normal((576,), key=mx.random.key(27))
    got = kernels.norm(x, weight, None, eps=1e-5, rms=True)
    np.testing.assert_allclose(np.array(got), np.array(mx.fast.rms_norm(x, weight, 1e-5)),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="last axis"):
        kernels.norm(x, mx.ones((5,)), None, eps=1e-5, rms=True)
    with pytest.raises(ValueError, match="no bias"):
        kernels.norm(x, weight, mx.zeros((576,)), eps=1e-5, rms=True)


def test_norm_layers_swap_in_with_mlx_gradients():
    from mlxvlm.cpu.norms import CPULayerNorm, CPURMSNorm, use_cpu_norms

    model = nn.Sequential(nn.LayerNorm(96), nn.RMSNorm(96), nn.LayerNorm(96, affine=False))
    reference = nn.Sequential(nn.LayerNorm(96), nn.RMSNorm(96), nn.LayerNorm(96, affine=False))
    model.layers[0].weight = mx.random.normal((96,), key=mx.random.key(28))
    model.layers[1].weight = mx.random.normal((96,), key=mx.random.key(29))
    reference.update(model.parameters())
    assert use_cpu_norms(model) == 3
    assert [type(m) for m in model.layers] == [CPULayerNorm, CPURMSNorm, CPULayerNorm]
    x = mx.random.normal((300, 96), key=mx.random.key(30))  # over fast_math.MIN_ELEMENTS
    np.testing.assert_allclose(np.array(model(x)), np.array(reference(x)), rtol=1e-4, atol=1e-4)

    def loss(m):
        def function(params, x):
            m.update(params)
            return (m(x) ** 2).sum()
        return function

    got = mx.grad(loss(model), argnums=(0, 1))(model.trainable_parameters(), x)
    want = mx.grad(loss(reference), argnums=(0, 1))(reference.trainable_parameters(), x)
    for (name, a), (_, b) in zip(tree_flatten(got), tree_flatten(want)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-3, err_msg=name)


def test_gemma_rms_norm_swaps_in_with_its_one_plus_weight_inside_the_kernel():
    """Gemma's RMSNorm scales by 1 + weight: the kernel adds the 1 itself (no addition
    in the graph on every call), with the results and gradients of mlx-lm's module."""
    from mlx_lm.models import gemma3_text

    from mlxvlm.cpu.norms import CPUGemmaRMSNorm, use_cpu_norms

    model, reference = nn.Sequential(gemma3_text.RMSNorm(96)), nn.Sequential(gemma3_text.RMSNorm(96))
    model.layers[0].weight = mx.random.normal((96,), key=mx.random.key(40)) * 0.1
    reference.update(model.parameters())
    assert use_cpu_norms(model) == 1 and type(model.layers[0]) is CPUGemmaRMSNorm
    x = mx.random.normal((3, 96), key=mx.random.key(41))
    np.testing.assert_allclose(np.array(model(x)), np.array(reference(x)), rtol=1e-5, atol=1e-5)
    direct = kernels.norm(x, model.layers[0].weight, None, eps=1e-5, rms=True, weight_offset=1.0)
    np.testing.assert_allclose(np.array(direct),
                               np.array(mx.fast.rms_norm(x, 1.0 + model.layers[0].weight, 1e-5)),
                               rtol=1e-5, atol=1e-5)

    def loss(m):
        def function(params, x):
            m.update(params)
            return (m(x) * mx.arange(96)).sum()
        return function

    got = mx.grad(loss(model), argnums=(0, 1))(model.trainable_parameters(), x)
    want = mx.grad(loss(reference), argnums=(0, 1))(reference.trainable_parameters(), x)
    for (name, a), (_, b) in zip(tree_flatten(got), tree_flatten(want)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4, err_msg=name)


def test_kernels_take_strided_inputs_as_they_come():
    """Inputs are read in place when row-major and copied inside the kernel otherwise
    (the graph gets no contiguous() node per input): a transposed input gives exactly
    the result of its contiguous copy."""
    keys = mx.random.split(mx.random.key(31), 3)
    x = mx.random.normal((64, 7), key=keys[0]).T  # (7, 64), column-major
    dense = mx.contiguous(x)
    w16 = mx.random.normal((24, 64), key=keys[1]).astype(mx.bfloat16)
    packed, scales, biases = mx.quantize(mx.random.normal((24, 64), key=keys[2]), 32, 4)
    pairs = [
        (lambda a: kernels.half_linear(a, w16)),
        (lambda a: kernels.quantized_linear(a, packed, scales, biases, group_size=32, bits=4)),
        (lambda a: kernels.activation(a, "silu", a)),
        (lambda a: kernels.norm(a, None, None, eps=1e-5)),
    ]
    for function in pairs:
        assert mx.array_equal(function(x), function(dense))


# --------------------------------------------------------------------------- attention


def _float64_attention(q, k, v, scale, mask=None, causal=False):
    q, k, v = (np.array(t, dtype=np.float64) for t in (q, k, v))
    repeats = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, repeats, axis=1), np.repeat(v, repeats, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * scale
    if mask is not None:  # a boolean one adds the lowest float32 where it is False
        mask = np.array(mask)
        if mask.dtype == bool:
            mask = np.where(mask, 0.0, np.finfo(np.float32).min)
        scores = scores + mask.astype(np.float64)
    if causal:  # the queries are the last positions: query i sees keys <= i + keys - queries
        queries, keys = scores.shape[-2:]
        visible = np.arange(queries)[:, None] + (keys - queries) >= np.arange(keys)[None]
        scores = np.where(visible, scores, -np.inf)
    with np.errstate(invalid="ignore"):  # a row with no visible key: NaN, as MLX gives
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return (weights / weights.sum(axis=-1, keepdims=True)) @ v


# (batch, heads, kv_heads, queries, keys, dims, mask, causal): key counts that are not a
# multiple of the 16-key panels or of the 64 keys a product pass takes, and that span
# several 1024-key softmax blocks, query counts that are not a multiple of the 6-row tiles
# or 48-query tiles, head sizes of every model family (64, 72, 80, 128, 256) and odd ones,
# masks broadcast every way.
ATTENTION_CASES = {
    "siglip": (1, 12, 12, 1024, 1024, 64, None, False),
    "so400m_odd_lengths": (1, 4, 4, 531, 531, 72, None, False),
    "qwen_vision_dims": (1, 3, 3, 130, 300, 80, None, False),
    "gqa_causal_prefill": (2, 6, 2, 151, 151, 64, None, True),
    "causal_after_a_cache": (1, 4, 2, 100, 613, 128, None, True),
    "more_queries_than_keys": (1, 2, 2, 60, 40, 32, None, True),  # first 20 rows: NaN
    "gemma_head": (1, 2, 1, 70, 290, 256, "additive", False),
    "odd_dims": (1, 3, 3, 37, 45, 20, "additive", True),
    "mask_over_keys_only": (2, 4, 4, 50, 270, 64, "keys", False),
    "mask_per_query_only": (1, 4, 4, 50, 66, 48, "queries", False),
    "rows_fully_masked": (1, 2, 2, 20, 300, 64, "minus_inf_rows", False),
    "boolean_mask": (2, 4, 2, 37, 300, 80, "boolean", False),
    "causal_over_key_blocks": (1, 4, 2, 90, 2200, 64, None, True),  # blocks 1024 + 1024 + 152
    # Odd rows see no key of the first 1024-key block, rows 3 and 7 none at all.
    "first_key_block_masked": (1, 2, 2, 20, 2100, 80, "late_keys", False),
    # The server's batched decoding: 8 sequences, one query each, 3 heads per kv head
    # (SmolVLM), the left padding of mlx-lm's batched caches as a boolean mask.
    "batched_decode": (8, 9, 3, 1, 93, 64, "boolean", False),
}


def _attention_case(batch, heads, kv_heads, queries, keys, dims, mask_kind, seed=0):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((batch, heads, queries, dims), key=k1) * 1.5
    k = mx.random.normal((batch, kv_heads, keys, dims), key=k2) * 1.5
    v = mx.random.normal((batch, kv_heads, keys, dims), key=k3)
    mask = {
        None: None,
        "additive": mx.random.normal((batch, heads, queries, keys), key=k4),
        "keys": mx.random.normal((batch, 1, 1, keys), key=k4),
        "queries": mx.random.normal((queries, 1), key=k4),
    }.get(mask_kind)
    if mask_kind == "boolean":  # True: attend; broadcast over heads
        mask = mx.random.uniform(shape=(batch, 1, queries, keys), key=k4) > 0.3
    if mask_kind == "minus_inf_rows":  # rows 3 and 7 see nothing; others lose half the keys
        hidden = (mx.arange(keys)[None] % 2 == 0) | (mx.arange(queries)[:, None] % 4 == 3)
        mask = mx.where(hidden, -mx.inf, 0.0)
    if mask_kind == "late_keys":  # odd rows: keys from 1100 on; rows 3 and 7: none
        rows, columns = mx.arange(queries)[:, None], mx.arange(keys)[None]
        hidden = ((rows % 2 == 1) & (columns < 1100)) | (rows % 4 == 3)
        mask = mx.where(hidden, -mx.inf, 0.0)
    return q, k, v, mask


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_matches_float64(case):
    """Every shape the models produce, on this CPU's attention path (AVX-512 register
    tiles or the sgemm path; the other paths run in test_narrower_instruction_sets...)."""
    batch, heads, kv_heads, queries, keys, dims, mask_kind, causal = ATTENTION_CASES[case]
    q, k, v, mask = _attention_case(batch, heads, kv_heads, queries, keys, dims, mask_kind)
    scale = dims**-0.5
    got = np.array(kernels.attention(q, k, v, scale=scale, mask="causal" if causal else mask),
                   dtype=np.float64)
    want = _float64_attention(q, k, v, scale, None if causal else mask, causal)
    assert got.shape == want.shape == (batch, heads, queries, dims)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))  # rows that see no key
    assert np.isnan(want).any() == (
        case in ("more_queries_than_keys", "rows_fully_masked", "first_key_block_masked"))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, equal_nan=True)


@pytest.mark.parametrize("B, L, H, KV, D", [(1, 1000, 4, 2, 64), (2, 517, 16, 16, 80),
                                           (3, 40, 4, 2, 64)])
def test_attention_over_many_blocks_from_strided_inputs(B, L, H, KV, D):
    """Queries in blocks of 256 (the last one ragged), q/k/v as the (B, L, H, D) ->
    (B, H, L, D) transposes models pass (the values are copied to consecutive rows per
    kv head), grouped-query heads, Qwen2-VL's tower's 16 x 80 heads, a broadcast mask;
    and few queries in several sequences (one task per sequence and kv head, each
    copying its values)."""
    keys = mx.random.split(mx.random.key(9), 4)
    q = mx.random.normal((B, L, H, D), key=keys[0]).transpose(0, 2, 1, 3)
    k = mx.random.normal((B, L, KV, D), key=keys[1]).transpose(0, 2, 1, 3)
    v = mx.random.normal((B, L, KV, D), key=keys[2]).transpose(0, 2, 1, 3)
    mask = mx.random.normal((L, L), key=keys[3])
    got = kernels.attention(q, k, v, scale=D**-0.5, mask=mask)
    assert got.shape == (B, H, L, D)
    want = _float64_attention(q, k, v, D**-0.5, mask)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-5)
    # The output is laid out (B, L, H, D): the transpose back is free and exact.
    flat = got.transpose(0, 2, 1, 3).reshape(B, L, H * D)
    np.testing.assert_allclose(np.array(flat), want.transpose(0, 2, 1, 3).reshape(B, L, -1),
                               rtol=1e-4, atol=1e-5)


def graph_operations(output: mx.array) -> list[str]:
    """The operations MLX would run to compute ``output``, sorted (from its dot export)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, output)
    return sorted(re.findall(r'label ="([^"]+)"', dot.getvalue()))


def test_a_boolean_mask_is_read_by_the_kernel_as_it_is(monkeypatch):
    """A model passes one mask to every layer (the server's batched decoding: a boolean
    one per step); the kernel reads it as it is, with no conversion operation per layer,
    and gives exactly what its additive form (the lowest float where False) gives."""
    q, k, v, _ = _attention_case(2, 4, 2, 3, 50, 32, None)
    mask = mx.random.uniform(shape=(2, 1, 3, 50), key=mx.random.key(13)) > 0.3
    additive = mx.where(mask, 0.0, mx.finfo(mx.float32).min)
    conversions = []
    where = mx.where
    monkeypatch.setattr(mx, "where", lambda *a, **kw: conversions.append(1) or where(*a, **kw))
    layers = [kernels.attention(q, k, v, scale=0.2, mask=mask) for _ in range(4)]
    assert len(conversions) == 0
    # Nor one in C++: between the evaluated mask and the kernel there is only its
    # broadcast (a float mask gets an AsType there, which this check sees).
    mx.eval(q, k, v, mask, additive)
    assert graph_operations(kernels.attention(q, k, v, scale=0.2, mask=mask)) == [
        "Broadcast", "MlxvlmAttention", "Transpose"]
    assert "AsType" in graph_operations(
        kernels.attention(q, k, v, scale=0.2, mask=mask.astype(mx.float16)))
    want = kernels.attention(q, k, v, scale=0.2, mask=additive)
    for got in layers:
        np.testing.assert_array_equal(np.array(got), np.array(want))
    other = mx.logical_not(mask)  # the next pass's mask
    np.testing.assert_array_equal(
        np.array(kernels.attention(q, k, v, scale=0.2, mask=other)),
        np.array(kernels.attention(q, k, v, scale=0.2,
                                   mask=where(other, 0.0, mx.finfo(mx.float32).min))))
    assert len(conversions) == 0
    # Derivatives: those of MLX's attention over the additive form.
    cotangent = mx.random.normal(want.shape, key=mx.random.key(14))
    for argument in range(3):
        def loss(t, m):
            args = [q, k, v]
            args[argument] = t
            return (kernels.attention(*args, scale=0.2, mask=m) * cotangent).sum()
        np.testing.assert_allclose(np.array(mx.grad(loss)((q, k, v)[argument], mask)),
                                   np.array(mx.grad(loss)((q, k, v)[argument], additive)),
                                   rtol=1e-5, atol=1e-6)


def test_attention_copies_inputs_whose_columns_are_strided():
    base = mx.random.normal((1, 2, 16, 40), key=mx.random.key(10))
    q = base.swapaxes(-1, -2)  # (1, 2, 40, 16) with column stride 40
    k = mx.random.normal((1, 2, 40, 16), key=mx.random.key(11))
    v = mx.random.normal((1, 2, 40, 16), key=mx.random.key(12))
    got = kernels.attention(q, k, v, scale=0.25)
    np.testing.assert_allclose(np.array(got), _float64_attention(q, k, v, 0.25),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ models

# The model tests import mlxvlm.load, the rope module and tests/parity.py where they run:
# these import transformers (and torch, which tests/conftest.py allows), which the kernel
# tests' subprocesses below need not pay for at start-up.
IMAGE = make_image(112, 84, seed=5)
PROMPT = "Describe this image."
FAMILIES = ["idefics3", "qwen2_vl", "gemma3", "llava", "paligemma"]


def _as_bf16_checkpoint(source, target):
    """A copy of an HF-layout checkpoint with its floating tensors stored as bfloat16."""
    shutil.copytree(source, target)
    for file in target.glob("*.safetensors"):
        tensors = mx.load(str(file))
        tensors = {n: t.astype(mx.bfloat16) if mx.issubdtype(t.dtype, mx.floating) else t
                   for n, t in tensors.items()}
        mx.save_safetensors(str(file), tensors, metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def bf16_checkpoints(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    return {f: _as_bf16_checkpoint(tiny_checkpoints.path(f, "hub"), root / f) for f in FAMILIES}


def _logits_and_tokens(model, processor):
    from parity import first_logits_and_greedy_tokens

    return first_logits_and_greedy_tokens(model, processor, PROMPT, IMAGE, max_tokens=12)


def _linear_like(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_checkpoint_keeps_bf16_weights_and_float32_results(bf16_checkpoints, family,
                                                                monkeypatch):
    from mlxvlm import load
    from mlxvlm.cpu.rope import CPURoPE

    path = bf16_checkpoints[family]
    model, processor = load(path)
    report = model.cpu_fast_paths
    layers = _linear_like(model)
    assert layers and report.half_layers == len(layers)
    assert all(type(m) in (CPUHalfLinear, CPUHalfEmbedding) for _, m in layers)
    half = {f"{n}.weight" for n, _ in layers}
    for name, value in tree_flatten(model.parameters()):
        assert value.dtype == (mx.bfloat16 if name in half else mx.float32), name
    assert report.half_bytes == sum(m.weight.nbytes for _, m in layers)
    assert "16-bit weights" in report.describe()
    # mlx-lm's rotary modules run on the rope kernel (Qwen2-VL's M-RoPE is its own).
    rotary = [m for _, m in model.named_modules() if isinstance(m, CPURoPE)]
    assert report.kernel_ropes == len(rotary) and bool(rotary) == (family != "qwen2_vl")
    logits, tokens = _logits_and_tokens(model, processor)

    monkeypatch.setenv(policy.NO_KERNELS_ENV, "1")
    reference, reference_processor = load(path)
    assert reference.cpu_fast_paths.half_layers == 0
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(reference.parameters()))
    want_logits, want_tokens = _logits_and_tokens(reference, reference_processor)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert tokens == want_tokens


def test_4bit_decoder_with_bf16_tower(bf16_checkpoints, tmp_path):
    """The quantized decoder stays packed on the quantized kernel, with its bf16 scales;
    the tower left in bf16 keeps bf16 weights; the results are MLX's quantized kernels'."""
    from mlxvlm import load
    from mlxvlm.checkpoint.loading import CONVERTED_MARKER

    source = bf16_checkpoints["qwen2_vl"]
    model, _ = load(source, cpu_fast_paths=False, dtype=mx.bfloat16)
    nn.quantize(model.language_model, group_size=32, bits=4)
    target = tmp_path / "qwen2_vl-bf16-4bit"
    shutil.copytree(source, target)
    for f in target.glob("*.safetensors"):
        f.unlink()
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    config = json.loads((target / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    config[CONVERTED_MARKER] = "mlx"
    (target / "config.json").write_text(json.dumps(config))

    quantized, processor = load(target, cpu_fast_paths=False)
    want_logits, want_tokens = _logits_and_tokens(quantized, processor)
    fast, fast_processor = load(target)
    report = fast.cpu_fast_paths
    assert report.kernel_quantized > 0 and report.dequantized == 0
    decoder = [m for _, m in fast.language_model.named_modules()
               if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    assert decoder and all(type(m) is CPUKernelQuantizedLinear and m.weight.dtype == mx.uint32
                           and m.scales.dtype == mx.bfloat16 for m in decoder)
    tower = [m for _, m in fast.vision_tower.named_modules() if isinstance(m, nn.Linear)]
    assert tower and all(type(m) is CPUHalfLinear and m.weight.dtype == mx.bfloat16
                         for m in tower)
    logits, tokens = _logits_and_tokens(fast, fast_processor)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert tokens == want_tokens


def test_lora_wraps_half_weight_layers():
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    linear = nn.Linear(24, 10)
    linear.weight = linear.weight.astype(mx.bfloat16)
    half = CPUHalfLinear(linear)
    x = mx.random.normal((2, 24), key=mx.random.key(13))
    for wrapper in (LoRALinear, DoRALinear):
        adapted = wrapper.from_base(half, r=4)
        adapted.lora_b = mx.random.normal(adapted.lora_b.shape, key=mx.random.key(14))
        float_base = nn.Linear(24, 10)
        float_base.update({"weight": linear.weight.astype(mx.float32), "bias": linear.bias})
        reference = wrapper.from_base(float_base, r=4)
        reference.update({"lora_a": adapted.lora_a, "lora_b": adapted.lora_b})
        if wrapper is DoRALinear:
            reference.m = adapted.m
        np.testing.assert_allclose(np.array(adapted(x)), np.array(reference(x)),
                                   rtol=1e-5, atol=1e-5)


def test_opt_out_keeps_float32_weights(bf16_checkpoints, monkeypatch):
    from mlxvlm import load

    monkeypatch.setenv(policy.NO_KERNELS_ENV, "1")
    assert not kernels.enabled() and kernels.describe() == f"disabled by {policy.NO_KERNELS_ENV}"
    model, _ = load(bf16_checkpoints["idefics3"])
    assert not any(isinstance(m, (CPUHalfLinear, CPUHalfEmbedding)) for _, m in model.named_modules())


def test_without_a_compiler_the_model_runs_on_float32_weights(bf16_checkpoints, tmp_path):
    """A fresh cache and no C++ compiler: mlxvlm says why and falls back."""
    script = (
        "import mlxvlm, mlx.core as mx\n"
        "from mlxvlm import load, generate\n"
        "from mlxvlm.cpu import kernels\n"
        "from mlx.utils import tree_flatten\n"
        "from tiny import make_image\n"
        "print('enabled', kernels.enabled())\n"
        "print('describe', kernels.describe())\n"
        f"model, processor = load({str(bf16_checkpoints['idefics3'])!r})\n"
        "print('dtypes', sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())}))\n"
        "out = generate(model, processor, 'Describe this image.', make_image(112, 84, seed=5),"
        " max_tokens=4)\n"
        "print('tokens', len(out.tokens))\n"
    )
    env = user_environment(  # a user's process: torch-free
        CXX=str(tmp_path / "no-such-compiler"), XDG_CACHE_HOME=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "enabled False" in result.stdout
    assert "describe not used: no C++ compiler found" in result.stdout
    assert "dtypes ['mlx.core.float32']" in result.stdout
    assert "tokens 4" in result.stdout


def test_thread_count_follows_the_environment():
    script = "import mlxvlm; from mlxvlm.cpu import kernels; print(kernels.describe())"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=dict(os.environ, MLXVLM_CPU_THREADS="1"), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    from mlxvlm.cpu import blas

    # With the BLAS shim (mlxvlm/cpu/blas_shim.c) the kernels run on its pool.
    shared = ", shared with the float32 products" if blas.gemv_forward is not None else ""
    assert f"({kernels.simd()}, 1 thread{shared});" in result.stdout, result.stdout


# Each kernel has code for AVX-512, AVX2 and any CPU (chosen at run time); this machine
# runs its widest in the tests above, and the narrower ones here, capped by
# MLXVLM_CPU_ISA, on the same kernel tests (in a subprocess: the choice is made once).
NARROWER = {"avx512": ["avx2", "portable"], "avx2": ["portable"], "portable": []}
KERNEL_TESTS = ("attention or half_linear or activation or quantized_linear or norm or "
                "strided")


def run_kernel_tests(selection: str, env: dict, shown: str) -> tuple[str, str]:
    """pytest on this file's tests ``selection`` names, in a fresh process under ``env``:
    its output, and what ``shown`` (an expression on ``kernels``) says there afterwards
    (the process's choices, made once, are those the tests ran under). The tests run
    torch-free, as a user's process: they need no torch, and transformers, imported by
    the norm tests through mlx-lm, would import it under tests/conftest.py's
    MLXVLM_ALLOW_TORCH=1 (seconds), so the session takes that setting back."""
    script = (
        "import os, sys, pytest\n"
        "class TorchFree:\n"
        "    def pytest_sessionstart(self, session):\n"
        "        os.environ.pop('MLXVLM_ALLOW_TORCH', None)\n"
        f"code = pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', {selection!r}],\n"
        "                   plugins=[TorchFree()])\n"
        "from mlxvlm.cpu import kernels\n"
        f"print('shown:', {shown})\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=600, env=env, cwd=os.path.dirname(__file__))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    output, _, said = result.stdout.rpartition("\nshown: ")
    assert " passed" in output and " failed" not in output
    return output, said.strip()


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_narrower_instruction_sets_give_the_same_results(isa):
    if isa not in NARROWER[kernels.simd()]:
        pytest.skip(f"this CPU's widest instruction set is {kernels.simd()}")
    _, shown = run_kernel_tests(f"({KERNEL_TESTS}) and not narrower and not models",
                                dict(os.environ, MLXVLM_CPU_ISA=isa), "kernels.simd()")
    assert shown == isa


@pytest.mark.parametrize("path", ["own", "blas"])
def test_both_prefill_paths_give_the_same_results(path):
    """Prefill's 16-bit and quantized products run on mlxvlm's AVX-512 GEMM or through the
    BLAS, the faster here (measured at first use); each, chosen with MLXVLM_HALF_GEMM,
    passes the half_linear and quantized_linear tests above, and says it was chosen so."""
    if path == "own" and kernels.simd() != "avx512":
        pytest.skip("mlxvlm's GEMM needs AVX-512")
    _, shown = run_kernel_tests("(half_linear or quantized_linear) and not narrower and not models",
                                dict(os.environ, MLXVLM_HALF_GEMM=path),
                                "kernels.prefill_products()")
    assert shown.endswith(f"(MLXVLM_HALF_GEMM={path})"), shown


def test_the_prefill_path_is_measured_and_described():
    """Without MLXVLM_HALF_GEMM the choice is measured (on AVX-512 CPUs) and shown by
    --verbose's description of the kernels."""
    described = kernels.prefill_products()
    if os.environ.get("MLXVLM_HALF_GEMM"):
        pytest.skip("the path is forced in this run")
    if kernels.simd() == "avx512":
        assert "measured at first use" in described and " ms against " in described
    else:
        assert described == "conversion + sgemm (the GEMM needs AVX-512)"
    assert described in kernels.describe()


def test_an_unknown_prefill_path_is_reported_and_ignored():
    script = "import mlxvlm; from mlxvlm.cpu import kernels; print(kernels.prefill_products())"
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=dict(os.environ, MLXVLM_HALF_GEMM="fast"), timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    described = shown.stdout.strip()
    assert described.endswith("; MLXVLM_HALF_GEMM='fast' ignored (expected own or blas)")
    if kernels.simd() == "avx512":  # chosen as without the variable: measured
        assert "measured at first use" in described, described


def test_an_unknown_instruction_set_cap_is_reported_and_ignored():
    script = ("import mlxvlm; from mlxvlm.cpu import kernels; "
              "print(kernels.describe()); print(kernels.simd())")
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=dict(os.environ, MLXVLM_CPU_ISA="sse9"), timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    described, used = shown.stdout.strip().splitlines()
    assert used == kernels.simd()  # the widest this CPU has, as without the variable
    assert "MLXVLM_CPU_ISA='sse9' ignored (expected one of avx512, avx2, portable)" in described
    assert "MLXVLM_CPU_ISA='sse9' ignored" in shown.stderr


def test_calling_a_kernel_that_could_not_be_built_says_why(monkeypatch):
    monkeypatch.setattr(kernels, "_attempted", True)
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "status", "not used: no C++ compiler found (c++/g++; set CXX)")
    assert not kernels.enabled()
    with pytest.raises(RuntimeError, match="CPU kernels are not used: no C\\+\\+ compiler"):
        kernels.half_linear(mx.zeros((1, 8)), mx.zeros((2, 8), dtype=mx.bfloat16))


def test_the_build_is_cached_per_source_and_toolchain():
    from mlxvlm.cpu.build_cache import cache_dir
    from mlxvlm.cpu.kernels import build

    first = build.build()
    assert first.exists() and cache_dir() in first.parents
    assert build.build() == first  # found, not rebuilt
