"""The rotary embedding kernel (``mlxvlm.cpu.kernels.rope``) and the modules that use it
(``mlxvlm.cpu.rope``): the rotation of MLX's ``mx.fast.rope`` computed in float64 from
its definition, MLX's gradients, and which modules are swapped."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import rope_utils

from mlxvlm.cpu import kernels, policy
from mlxvlm.cpu.rope import CPURoPE, use_cpu_rope


def _float64_rope(x, dims, traditional, base, scale, offset, freqs=None):
    """mx.fast.rope's definition (mlx/fast.cpp): angles rounded to float32 as there (at
    position 4000 that rounding alone moves a result by ~1e-4), the rest in float64."""
    x = np.array(x, dtype=np.float64)
    squeeze = x.ndim == 3
    if squeeze:
        x = x[:, None]
    T, half = x.shape[-2], dims // 2
    inverse = (1.0 / np.array(freqs, dtype=np.float64) if freqs is not None
               else np.exp(-np.arange(half) * math.log(base) / half)).astype(np.float32)
    offsets = np.broadcast_to(np.array(offset).reshape(-1), (x.shape[0],))
    positions = ((np.arange(T)[None] + offsets[:, None]) * np.float32(scale)).astype(np.float32)
    angle = (positions[:, None, :, None] * inverse).astype(np.float64)  # (B, 1, T, half)
    cos, sin = np.cos(angle), np.sin(angle)
    out = x.copy()
    if traditional:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2], out[..., 1:dims:2] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., :half], x[..., half:dims]
        out[..., :half], out[..., half:dims] = a * cos - b * sin, a * sin + b * cos
    return out[:, 0] if squeeze else out


CASES = {
    "halves": dict(dims=64, traditional=False, offset=0),
    "pairs": dict(dims=64, traditional=True, offset=5),
    "partial-halves": dict(dims=32, traditional=False, offset=17),
    "partial-pairs": dict(dims=16, traditional=True, offset=3),
    "long-offset": dict(dims=64, traditional=False, offset=4000),
    "per-batch-offsets": dict(dims=64, traditional=False, offset=[2, 900]),
}


@pytest.mark.parametrize("layout", ["row-major", "heads-moved"])
@pytest.mark.parametrize("case", list(CASES))
def test_rope_matches_its_float64_definition(case, layout):
    settings = CASES[case]
    key = mx.random.key(1)
    if layout == "row-major":
        x = mx.random.normal((2, 3, 7, 64), key=key)
    else:  # what attention layers pass: (B, L, H, D) with the heads moved forward
        x = mx.random.normal((2, 7, 3, 64), key=key).transpose(0, 2, 1, 3)
    offset = settings["offset"]
    offset_arg = mx.array(offset, dtype=mx.int32) if isinstance(offset, list) else offset
    got = kernels.rope(x, settings["dims"], traditional=settings["traditional"], base=10000.0,
                       scale=0.5, offset=offset_arg)
    want = _float64_rope(x, settings["dims"], settings["traditional"], 10000.0, 0.5, offset)
    assert got.dtype == mx.float32 and got.shape == x.shape
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    # MLX's own composition computes its frequencies and sin/cos with vectorised
    # approximations: ~1e-6 from the definition at small angles, ~2e-4 at ~2000 rad.
    mlx_result = mx.fast.rope(x, settings["dims"], traditional=settings["traditional"],
                              base=10000.0, scale=0.5, offset=offset_arg)
    np.testing.assert_allclose(np.array(got), np.array(mlx_result), rtol=1e-4, atol=5e-4)


def test_rope_with_frequencies_and_three_axes():
    x = mx.random.normal((1, 9, 32), key=mx.random.key(2))  # (B, T, D): one head
    freqs = mx.random.uniform(1.0, 500.0, (16,), key=mx.random.key(3))
    got = kernels.rope(x, 32, traditional=False, base=None, scale=1.0, offset=mx.array(11),
                       freqs=freqs)
    want = _float64_rope(x, 32, False, None, 1.0, 11, freqs=np.array(freqs))
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    # Infinite frequencies (mlx-lm's ProportionalRoPE pads with them): no rotation.
    still = kernels.rope(x, 32, traditional=False, base=None, scale=1.0, offset=4,
                         freqs=mx.full((16,), mx.inf))
    assert mx.array_equal(still, x)


def test_rope_gradients_are_mlxs():
    x = mx.random.normal((1, 4, 6, 32), key=mx.random.key(4))
    weights = mx.random.normal((1, 4, 6, 32), key=mx.random.key(5))

    def loss(rope):
        return lambda x: (rope(x, 32, traditional=False, base=500.0, scale=1.0, offset=9)
                          * weights).sum()

    got = mx.grad(loss(kernels.rope))(x)
    want = mx.grad(loss(mx.fast.rope))(x)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)
    tangent = mx.random.normal(x.shape, key=mx.random.key(6))
    _, (got_jvp,) = mx.jvp(lambda x: kernels.rope(x, 32, traditional=True, base=500.0,
                                                  scale=1.0, offset=9), [x], [tangent])
    _, (want_jvp,) = mx.jvp(lambda x: mx.fast.rope(x, 32, traditional=True, base=500.0,
                                                   scale=1.0, offset=9), [x], [tangent])
    np.testing.assert_allclose(np.array(got_jvp), np.array(want_jvp), rtol=1e-4, atol=1e-5)


def test_rope_checks_its_arguments():
    x = mx.zeros((1, 2, 3, 8))
    with pytest.raises(ValueError, match="float32"):
        kernels.rope(x.astype(mx.float16), 8, traditional=False, base=1e4, scale=1.0, offset=0)
    with pytest.raises(ValueError, match="even"):
        kernels.rope(x, 7, traditional=False, base=1e4, scale=1.0, offset=0)
    with pytest.raises(ValueError, match="even"):
        kernels.rope(x, 10, traditional=False, base=1e4, scale=1.0, offset=0)
    with pytest.raises(ValueError, match="exactly one"):
        kernels.rope(x, 8, traditional=False, base=1e4, scale=1.0, offset=0, freqs=mx.ones(4))
    with pytest.raises(ValueError, match="one per batch"):
        kernels.rope(x, 8, traditional=False, base=1e4, scale=1.0, offset=mx.array([1, 2]))
    with pytest.raises(ValueError, match="at least 3"):
        kernels.rope(mx.zeros((3, 8)), 8, traditional=False, base=1e4, scale=1.0, offset=0)


def _rotary_modules():
    """Every kind of rotary module mlx-lm's ``initialize_rope`` makes, by rope type."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    return {
        "default": (rope_utils.initialize_rope(64, 10000.0, False), True),
        "linear": (rope_utils.initialize_rope(64, 10000.0, True, {"type": "linear",
                                                                 "factor": 2.0}), True),
        "llama3": (rope_utils.initialize_rope(64, 500000.0, False, llama3, 131072), True),
        "proportional": (rope_utils.ProportionalRoPE(64, 32, base=10000.0), True),
        "yarn": (rope_utils.initialize_rope(64, 10000.0, False, yarn, 16384), False),
    }


@pytest.mark.parametrize("kind", list(_rotary_modules()))
def test_rotary_modules_swap_in_and_compute_the_same(kind):
    module, swapped = _rotary_modules()[kind]
    holder = nn.Module()
    holder.rope = module
    assert use_cpu_rope(holder) == int(swapped)
    assert isinstance(holder.rope, CPURoPE) == swapped
    x = mx.random.normal((1, 4, 5, 64), key=mx.random.key(7))
    for offset in (0, 300):
        np.testing.assert_allclose(np.array(holder.rope(x, offset=offset)),
                                   np.array(module(x, offset=offset)), rtol=1e-4, atol=1e-4)
    if swapped:
        # Anything but float32 goes to the replaced module: exactly its result.
        half = x.astype(mx.bfloat16)
        assert mx.array_equal(holder.rope(half, offset=3), module(half, offset=3))
        assert holder.parameters() == {"rope": {}}  # the replaced module is not a child


def test_opting_out_of_the_kernels_gives_mlxs_rope(monkeypatch):
    module = nn.RoPE(64, base=10000.0)
    holder = nn.Module()
    holder.rope = module
    use_cpu_rope(holder)
    x = mx.random.normal((1, 4, 5, 64), key=mx.random.key(8))
    assert not mx.array_equal(holder.rope(x, offset=40), module(x, offset=40))
    monkeypatch.setenv(policy.NO_KERNELS_ENV, "1")
    assert mx.array_equal(holder.rope(x, offset=40), module(x, offset=40))


def _rotate_half_composition(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("layout", ["row-major", "heads-moved"])
def test_rotary_from_tables_is_the_composition(layout):
    """``kernels.rotary`` (Qwen's M-RoPE, the Qwen/Pixtral towers): x * cos +
    rotate_half(x) * sin with tables broadcast over heads and batch, exactly; its
    derivatives for x and both tables are the composition's."""
    keys = mx.random.split(mx.random.key(9), 3)
    if layout == "row-major":  # (B, L, H, D), the decoder's layout
        x = mx.random.normal((2, 5, 4, 16), key=keys[0])
    else:
        x = mx.random.normal((2, 4, 5, 16), key=keys[0]).transpose(0, 2, 1, 3)
    cos = mx.random.normal((5, 1, 16), key=keys[1])  # one per position, shared by heads
    sin = mx.random.normal((2, 5, 1, 16), key=keys[2])  # one per batch entry and position
    assert mx.array_equal(kernels.rotary(x, cos, sin), _rotate_half_composition(x, cos, sin))

    def loss(rotate):
        return lambda x, cos, sin: (rotate(x, cos, sin) ** 2).sum()

    got = mx.grad(loss(kernels.rotary), argnums=(0, 1, 2))(x, cos, sin)
    want = mx.grad(loss(_rotate_half_composition), argnums=(0, 1, 2))(x, cos, sin)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    _, (got_jvp,) = mx.jvp(kernels.rotary, [x, cos, sin], [x, cos, sin])
    _, (want_jvp,) = mx.jvp(_rotate_half_composition, [x, cos, sin], [x, cos, sin])
    np.testing.assert_allclose(np.array(got_jvp), np.array(want_jvp), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="broadcast"):
        kernels.rotary(x, mx.zeros((3, 1, 16)), sin)
    with pytest.raises(ValueError, match="float32"):
        kernels.rotary(x.astype(mx.float16), cos, sin)


def test_the_models_rotation_takes_the_kernel_on_float32_only(monkeypatch):
    from mlxvlm.models.layers.rotary import apply_rotary

    x = mx.random.normal((1, 3, 2, 8), key=mx.random.key(10))
    cos, sin = mx.cos(mx.arange(24).reshape(3, 1, 8)), mx.sin(mx.arange(24).reshape(3, 1, 8))
    calls = []
    original = kernels.rotary
    monkeypatch.setattr(kernels, "rotary", lambda *a: calls.append(1) or original(*a))
    assert mx.array_equal(apply_rotary(x, cos, sin), _rotate_half_composition(x, cos, sin))
    assert calls == [1]
    half = apply_rotary(x.astype(mx.bfloat16), cos.astype(mx.bfloat16), sin.astype(mx.bfloat16))
    assert half.dtype == mx.bfloat16 and calls == [1]
    monkeypatch.setenv(policy.NO_KERNELS_ENV, "1")
    apply_rotary(x, cos, sin)
    assert calls == [1]
