"""Exponential-based functions that are fast on MLX's CPU backend.

Why: the ``mlx[cpu]`` wheel for x86-64 is built for the baseline instruction set, so its
``exp`` (and ``tanh``, ``erf``, ``sigmoid``) evaluate one float at a time through a
software ``fma``; softmax and GELU over a vision tower's activations spend most of their
time there (benchmarks/README.md has the figures).

What: where mlxvlm's C++ kernels are built, each function here is one kernel call
(``kernels.activation``). Without them: the same Cephes polynomial MLX itself uses
(``exp(x) = 2**n * p(f)``, ``n`` the nearest integer to ``x / ln 2``), written as MLX
array arithmetic that ``mx.compile`` turns into plain loops the C++ compiler vectorises,
with the same maximum relative error as ``mx.exp``. Large arrays are evaluated in
slices, as those loops are faster while their data stays in cache.

Every function here has the backward pass of the standard MLX function it replaces
(``with_reference_vjp``), so fine-tuning differentiates exactly what it did before.
``policy.fast_math_applies(x)`` decides: float32 arrays on the CPU backend, unless
``MLXVLM_NO_CPU_FAST_PATHS`` is set. Elsewhere (Metal, CUDA, half precision) callers
get MLX's own functions unchanged.
"""

from __future__ import annotations

import math
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.cpu import kernels, policy

# Smaller arrays (decode steps) keep MLX's single fused kernel: fewer dispatches.
MIN_ELEMENTS = 1 << 14
# Elements per slice: 786 K float32 (3 MB) measured fastest among 256 K .. 4 M.
SLICE_ELEMENTS = 1 << 19

_LOG2E = 1.4426950408889634
# Adding then subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to the nearest
# integer (no floor(): on this baseline build it is a libm call that stops vectorisation).
_ROUNDING = 12582912.0
# 2**f for f in [-0.5, 0.5] (Cephes, as in MLX's simd/math.h), lowest degree first.
_EXP2_COEFFICIENTS = (
    1.0,
    6.931472028550421e-1,
    2.402264791363012e-1,
    5.550332471162809e-2,
    9.618437357674640e-3,
    1.339887440266574e-3,
    1.535336188319500e-4,
)


# The work is split into small compiled functions because MLX fuses one output per kernel
# and at most ~10 operations deep; each piece below becomes one loop.
@mx.compile
def _log2_scaled(x: mx.array) -> mx.array:
    # Clamped with where(), not clip(): MLX's maximum/minimum branch on NaN per element
    # and do not vectorise (1.2 ms against 0.5 ms here). NaN passes through to the result.
    y = x * _LOG2E
    y = mx.where(y < -127.0, -127.0, y)
    return mx.where(y > 127.0, 127.0, y)


@mx.compile
def _nearest_integer(y: mx.array) -> mx.array:
    return (y + _ROUNDING) - _ROUNDING


@mx.compile
def _power_of_two_bits(n: mx.array) -> mx.array:
    # The float32 bit pattern of 2**n; n = -127 gives +0.0, as exp underflows to 0.
    return (n.astype(mx.int32) + 127) << 23


@mx.compile
def _exp2_fraction_times(y: mx.array, n: mx.array, power: mx.array) -> mx.array:
    f = y - n
    f2 = f * f
    c = _EXP2_COEFFICIENTS
    # Estrin's scheme: the same polynomial as Horner's, half the dependency depth.
    p = (c[0] + c[1] * f) + f2 * ((c[2] + c[3] * f) + f2 * ((c[4] + c[5] * f) + f2 * c[6]))
    return p * power


def exp_kernel(x: mx.array) -> mx.array:
    """``exp`` of a float32 array, without slicing or dispatch (see the module doc)."""
    y = _log2_scaled(x)
    n = _nearest_integer(y)
    return _exp2_fraction_times(y, n, _power_of_two_bits(n).view(mx.float32))


@mx.compile
def _halve_by_maximum(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.maximum(x[..., :half], x[..., half:])


def max_last_axis(x: mx.array) -> mx.array:
    """``x.max(axis=-1, keepdims=True)``, about twice as fast on the CPU: element-wise
    maxima of the two halves (vectorised) until a short row is left to reduce."""
    while x.shape[-1] >= 256 and x.shape[-1] % 2 == 0:
        x = _halve_by_maximum(x)
    return x.max(axis=-1, keepdims=True)


def in_slices(fn: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """``fn`` (elementwise) over ``x`` in slices along the leading axes, so that each
    slice's kernels run in cache."""
    if x.size <= SLICE_ELEMENTS or x.ndim == 0:
        return fn(x)
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, SLICE_ELEMENTS // rows.shape[1])
    if step >= rows.shape[0]:
        return fn(x)
    parts = [fn(rows[start : start + step]) for start in range(0, rows.shape[0], step)]
    return mx.concatenate(parts).reshape(x.shape)


def with_reference_vjp(fast: Callable, reference: Callable) -> Callable:
    """``fast`` forward, with the vector-Jacobian product of ``reference`` (the standard
    MLX function it computes), so gradients are those of the standard path."""

    @mx.custom_function
    def function(*arrays):
        return fast(*arrays)

    @function.vjp
    def function_vjp(primals, cotangent, output):
        # One input arrives as an array, several as a tuple.
        primals = [primals] if isinstance(primals, mx.array) else list(primals)
        _, grads = mx.vjp(lambda *a: reference(*a), primals, [cotangent])
        return tuple(grads) if len(grads) > 1 else grads[0]

    return function


_mlx_exp = with_reference_vjp(lambda x: in_slices(exp_kernel, x), mx.exp)


# The kernel's primitive carries mx.exp's derivatives itself (no custom_function around
# it, which would hold on to x and keep the kernel from writing over x's buffer).
def _kernel_exp(x: mx.array) -> mx.array:
    return kernels.activation(x, "exp")


def exp(x: mx.array) -> mx.array:
    """``mx.exp``, fast on the CPU (on the MLX composition, inputs above 88 give ~2.4e38
    rather than inf)."""
    if not policy.fast_math_applies(x):
        return mx.exp(x)
    return _kernel_exp(x) if kernels.enabled() else _mlx_exp(x)


def logsumexp_last(x: mx.array) -> mx.array:
    """``mx.logsumexp(x, axis=-1, keepdims=True)``: on the CPU with mlxvlm's kernels, the
    exponentials by the vectorised kernel (MLX's logsumexp takes them one float at a time:
    a step's log-probabilities over a 49k-word vocabulary cost ~1 ms a row). The same
    steps as MLX's: the row maximum, log of the sum of exp(x - max), plus the maximum,
    and the maximum itself where it is infinite."""
    if not policy.fast_math_applies(x) or not kernels.enabled():
        return mx.logsumexp(x, axis=-1, keepdims=True)
    return _logsumexp_with_reference_vjp(x)


def _logsumexp_fast(x: mx.array) -> mx.array:
    top = mx.stop_gradient(x.max(axis=-1, keepdims=True))
    total = mx.log(_kernel_exp(x - top).sum(axis=-1, keepdims=True)) + top
    return mx.where(mx.isinf(top), top, total)


_logsumexp_with_reference_vjp = with_reference_vjp(
    _logsumexp_fast, lambda x: mx.logsumexp(x, axis=-1, keepdims=True))


# GELU, tanh form: 0.5 x (1 + tanh(u)) = x * sigmoid(2u) = x / (1 + exp(-2u)),
# u = sqrt(2/pi) (x + 0.044715 x^3).
_GELU_TANH_SCALE = -2.0 * math.sqrt(2.0 / math.pi)


@mx.compile
def _gelu_tanh_exponent(x: mx.array) -> mx.array:
    return _GELU_TANH_SCALE * (x + 0.044715 * (x * x * x))


@mx.compile
def _times_sigmoid_from_exp(x: mx.array, e: mx.array) -> mx.array:
    return x / (1.0 + e)


def _gelu_tanh_kernel(x: mx.array) -> mx.array:
    return _times_sigmoid_from_exp(x, exp_kernel(_gelu_tanh_exponent(x)))


def _quick_gelu_kernel(x: mx.array) -> mx.array:
    return _times_sigmoid_from_exp(x, exp_kernel(-1.702 * x))


def _silu_kernel(x: mx.array) -> mx.array:
    return _times_sigmoid_from_exp(x, exp_kernel(-x))


def _dispatching(fast_kernel: Callable, reference: Callable, kind: str) -> Callable:
    """``reference`` (an MLX activation) computed by mlxvlm's C++ kernel where it is built,
    else by ``fast_kernel`` (the MLX composition above), on large float32 CPU arrays."""
    composed = with_reference_vjp(lambda x: in_slices(fast_kernel, x), reference)

    def kernel(x: mx.array) -> mx.array:  # with reference's derivatives (see _kernel_exp)
        return kernels.activation(x, kind)

    def function(x: mx.array) -> mx.array:
        if x.size < MIN_ELEMENTS or not policy.fast_math_applies(x):
            return reference(x)
        return kernel(x) if kernels.enabled() else composed(x)

    function.__name__ = reference.__name__
    function.__doc__ = f"``{reference.__module__}.{reference.__name__}``, fast on the CPU."
    function.reference = reference  # the MLX function it stands for
    function.kind = kind  # its name in kernels.ACTIVATIONS
    return function


gelu_tanh = _dispatching(_gelu_tanh_kernel, nn.gelu_approx, "gelu_tanh")
quick_gelu = _dispatching(_quick_gelu_kernel, nn.gelu_fast_approx, "quick_gelu")
silu = _dispatching(_silu_kernel, nn.silu, "silu")


def gated(act: Callable) -> Callable[[mx.array, mx.array], mx.array]:
    """``(gate, up) -> act(gate) * up`` for one of this module's activations: mlxvlm's
    kernel at every size where it is built (one operation, vectorised: MLX's compiled
    kernel, below, computes its exponentials one float at a time, a tenth of a batched
    decode step's time); without it, on large arrays through ``act``'s fast path, on
    small ones (decode steps) as one compiled MLX kernel, like mlx-lm's ``swiglu``."""
    reference = act.reference
    fused = mx.compile(lambda gate, up: reference(gate) * up, shapeless=True)

    def kernel(gate: mx.array, up: mx.array) -> mx.array:  # reference's derivatives too
        return kernels.activation(gate, act.kind, up)

    def function(gate: mx.array, up: mx.array) -> mx.array:
        if not policy.fast_math_applies(gate):
            return fused(gate, up)
        if kernels.enabled() and up.shape == gate.shape:
            return kernel(gate, up)
        return fused(gate, up) if gate.size < MIN_ELEMENTS else act(gate) * up

    return function
