"""mlxvlm's CPU kernels for MLX: attention, activations, norms, rotations, and linear
layers on 16-bit or quantized weights.

MLX primitives (C++ in this folder, compiled on first use by ``build.py``):

- ``attention(q, k, v, scale=, mask=)``: softmax(scale q k^T + mask) v in float32. With
  AVX-512: register-tiled products fused with an online softmax, query tiles spread over
  the CPU threads; elsewhere: blocked so the scores stay in cache, the matmuls through
  the process's BLAS, a vectorised softmax.
- ``half_linear(x, weight, bias=None, residual=None)``: x (float32) times a
  bfloat16/float16 weight, computed in float32 without keeping a float32 copy of the
  weight, so a bf16 checkpoint runs at float32 speed with half the memory. A residual
  (the output's shape) is summed in the pass that writes the output rows, in place of a
  separate addition (``half_weights.residual_plus``). Prefill's products (more than four
  rows) run on a blocked AVX-512 GEMM of mlxvlm's own where it measures faster than the
  weights converted into the BLAS (``prefill_products()`` says which);
  ``MLXVLM_HALF_GEMM=own`` or ``blas`` chooses.
- ``gathered_half_linear(x, bank, experts)``: a mixture-of-experts bank of 16-bit
  matrices (experts, N, K) applied to each row of x with its own expert (mlx-lm's
  ``SwitchLinear``), in float32 without a float32 copy of the bank: the rows grouped by
  expert, each group one ``half_linear`` product over its expert's matrix.
- ``quantized_linear(x, weight, scales, biases, group_size=, bits=)``: MLX's affine
  4/8-bit layers computed on the packed weights (decode) or dequantized a chunk at a
  time into BLAS (prefill), so quantized checkpoints stay quantized in memory.
- ``norm(x, weight, bias, eps=, rms=)``: LayerNorm / RMSNorm, vectorised and threaded.
- ``rope(x, dims, traditional=, base=, scale=, offset=, freqs=)``: ``mx.fast.rope`` as
  one operation (MLX's CPU backend composes it from ~20, whose dispatch is what a
  decoding step pays for); ``rotary(x, cos, sin)``: ``x * cos + rotate_half(x) * sin``
  from a model's own tables (Qwen's M-RoPE) as one operation, not seven.
- ``activation(x, kind, up=None)``: GELU (tanh form), quick GELU, SiLU or exp, optionally
  times ``up`` (gated MLPs), vectorised and threaded.

Used only on MLX's CPU backend (``fast_paths``, ``attention``, ``fast_math``);
``MLXVLM_NO_CPU_KERNELS=1`` opts out, and so does ``MLXVLM_NO_CPU_FAST_PATHS`` (every
``MLXVLM_*`` setting is read in ``policy``; ``load`` hands the kernels theirs). When the build is not possible (no C++ compiler, Python headers or
nanobind) mlxvlm keeps its MLX-only paths and ``describe()`` says why. The instruction
set (AVX-512, AVX2 or portable loops) is chosen at run time; ``MLXVLM_CPU_ISA=avx2`` or
``portable`` caps it. Figures are in benchmarks/README.md.
"""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from mlxvlm.cpu import policy

status: str = "not loaded yet"
_module: ModuleType | None = None
_attempted = False
_loading = threading.Lock()  # one build and one import per process (the server's threads)


def _sgemm_address() -> int:
    """The cblas_sgemm libmlx uses: OpenBLAS (through mlxvlm's sgemv shim) when
    ``mlxvlm.cpu.blas`` loaded it globally, else libmlx's own BLAS."""
    try:
        return ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        libmlx = Path(mx.__file__).resolve().parent / "lib" / "libmlx.so"
        return ctypes.cast(ctypes.CDLL(str(libmlx)).cblas_sgemm, ctypes.c_void_p).value


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> ModuleType | None:
    """The kernels module (built on first use), or None with ``status`` saying why."""
    global _module, _attempted
    if _attempted:
        return _module
    with _loading:
        if not _attempted:
            _module = _build_and_import()
            _attempted = True
    return _module


def _build_and_import() -> ModuleType | None:
    global status
    from mlxvlm.cpu.kernels.build import BuildError, build

    try:
        module = _import(build(verbose=True))
        module.set_sgemm(_sgemm_address())
        module.set_threads(policy.cpu_threads())  # for its own pool, without the shim
        # Before the first kernel runs: the kernels decide both once per process.
        module.set_isa_cap(policy.isa_cap())
        module.set_half_gemm(policy.half_gemm())
        _smoke_call(module)
    except (BuildError, OSError, ImportError, AttributeError, TypeError, RuntimeError,
            subprocess.SubprocessError) as exc:
        status = f"not used: {exc}"
        print(f"mlxvlm: CPU kernels {status}", file=sys.stderr)
        return None
    threads = module.threads()
    status = (f"attention, activation, norm, rotary, 16-bit (dense and expert bank) and "
              f"quantized linear kernels "
              f"({module.simd()}, {threads} thread{'s' if threads != 1 else ''}"
              f"{', shared with the float32 products' if module.shares_blas_pool() else ''})")
    cap = policy.isa_cap_ignored()
    if cap is not None:  # the kernels then use the widest set the CPU has
        isa, isas = policy.ISA_ENV, ", ".join(policy.ISAS)
        status += f"; {isa}={cap!r} ignored (expected one of {isas})"
        print(f"mlxvlm: {isa}={cap!r} ignored: expected one of {isas}", file=sys.stderr)
    return module


def _smoke_call(module: ModuleType) -> None:
    """One small call through the binding at load: an extension that imports but cannot
    pass MLX arrays (a nanobind ABI other than mlx.core's) fails here, where mlxvlm can
    still fall back, instead of in the middle of a forward pass."""
    x = mx.array([[-2.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 4.0]])
    got = module.activation(x, module.Activation.silu, None)
    expected = x * mx.sigmoid(x)
    if not mx.allclose(got, expected, atol=1e-5).item():
        raise RuntimeError("the built kernels failed their first call (SiLU of 8 floats "
                           "differs from MLX's)")


def enabled() -> bool:
    """Whether the kernels apply here: the CPU backend, not opted out, built."""
    return policy.fast_paths_enabled() and not policy.kernels_disabled() and load() is not None


def _require() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError(f"mlxvlm's CPU kernels are {status}")
    return module


def simd() -> str:
    """The instruction set the kernels run with here: "avx512", "avx2" or "portable"."""
    return _require().simd()


def describe() -> str:
    """What the kernels do here, or why they are not used (for ``--verbose``)."""
    if policy.kernels_disabled():
        return f"disabled by {policy.NO_KERNELS_ENV}"
    if load() is None:
        return status
    return (f"{status}; prefill products of 16-bit and quantized weights: "
            f"{prefill_products()}")


def prefill_products() -> str:
    """How ``half_linear`` and ``quantized_linear`` compute products of more than four rows
    here, and why: mlxvlm's AVX-512 GEMM or the weights converted into the process's
    sgemm, the faster of the two on this CPU (measured once per process) unless
    ``MLXVLM_HALF_GEMM`` is "own" or "blas"."""
    return _require().prefill_products()


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None) -> mx.array:
    """softmax(scale q k^T + mask) v in float32 (see the module docstring). ``mask``: None,
    ``"causal"``, a boolean array (True = attend) or an additive one."""
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        raise ValueError(f"unknown mask {mask!r}")
    array_mask = None if causal or mask is None else mask  # boolean masks: read as they are
    return _require().attention(q, k, v, scale=scale, causal=causal, mask=array_mask)


ACTIVATIONS = ("gelu_tanh", "quick_gelu", "silu", "exp")


def activation(x: mx.array, kind: str, up: mx.array | None = None) -> mx.array:
    """``kind`` (one of ACTIVATIONS) of x in float32, times ``up`` if given."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"unknown activation {kind!r}; one of {ACTIVATIONS}")
    module = _require()
    return module.activation(x, getattr(module.Activation, kind), up)


def norm(x: mx.array, weight: mx.array | None, bias: mx.array | None, *, eps: float,
         rms: bool = False, weight_offset: float = 0.0) -> mx.array:
    """LayerNorm (``rms=False``, like ``mx.fast.layer_norm``) or RMSNorm (like
    ``mx.fast.rms_norm``; ``bias`` must be None) over the last axis, in float32, scaled by
    ``weight + weight_offset`` (Gemma's RMSNorm: offset 1)."""
    return _require().norm(x, weight, bias, eps=eps, rms=rms, weight_offset=weight_offset)


def rope(x: mx.array, dims: int, *, traditional: bool, base: float | None, scale: float,
         offset: int | mx.array, freqs: mx.array | None = None) -> mx.array:
    """``mx.fast.rope(x, dims, traditional=, base=, scale=, offset=, freqs=)`` for float32
    ``x`` (..., positions, features), as one operation; ``offset`` an int, a scalar or one
    per entry of x's first axis."""
    if not isinstance(offset, mx.array):
        offset = mx.array(offset, dtype=mx.int32)
    return _require().rope(x, dims, traditional=traditional, base=base, scale=scale,
                           offset=offset, freqs=freqs)


def rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """``x * cos + rotate_half(x) * sin`` (transformers' rotary embedding, rotate_half(x)
    = [-x2, x1] of x's halves) for float32 ``x`` and tables that broadcast to it."""
    return _require().rotary(x, cos, sin)


QUANTIZED_BITS = (4, 8)


def quantized_linear(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, *,
                     group_size: int, bits: int, bias: mx.array | None = None) -> mx.array:
    """``x @ mx.dequantize(weight, scales, biases, group_size, bits).T (+ bias)`` in
    float32, on MLX's affine 4/8-bit packed weights (group_size a multiple of 8)."""
    return _require().quantized_linear(x, weight, scales, biases, group_size=group_size,
                                       bits=bits, bias=bias)


def half_linear(x: mx.array, weight: mx.array, bias: mx.array | None = None,
                residual: mx.array | None = None) -> mx.array:
    """``x @ weight.T (+ bias) (+ residual)`` in float32 for a bfloat16/float16 ``weight``
    (N, K); ``residual`` (the output's shape) is summed in the product's own output pass,
    in place of a separate addition."""
    return _require().half_linear(x, weight, bias, residual)


def gathered_half_linear(x: mx.array, bank: mx.array, experts: mx.array) -> mx.array:
    """``x[..., None, :] @ bank[experts].swapaxes(-1, -2)`` squeezed, in float32: row i of
    ``x`` (..., K) times the transpose of expert ``experts[i]``'s matrix of a
    bfloat16/float16 ``bank`` (E, N, K); ``experts`` has x's shape without its last axis.
    A row whose expert is out of range gets zeros."""
    return _require().gathered_half_linear(x, bank, experts)
