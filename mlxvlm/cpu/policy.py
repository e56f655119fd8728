"""Every setting of mlxvlm's CPU backend, and the one rule that turns its fast paths on.

This module is a leaf: it imports only the standard library at import time, because
``mlxvlm`` reads it (through ``mlxvlm.cpu.blas``) before ``mlx.core`` may be imported.
It is the only code in mlxvlm, Python or C++, that reads the backend's ``MLXVLM_*``
variables: the C++ kernels and the BLAS shim are handed the values (tests/test_cpu_policy.py
checks that nothing else reads them). Each function reads its variable when called, never
once at import: the tests (and a program that changes its environment) set a variable
and see its effect on the next call.

The settings, by what uses them:

- before MLX loads (``blas``, ``malloc``): ``MLXVLM_NO_OPENBLAS``,
  ``MLXVLM_NO_GEMV_FORWARD`` (the BLAS shim), ``MLXVLM_CPU_THREADS`` (the one pool's
  size, also handed to the kernels for their own pool when there is no shim),
  ``MLXVLM_CPU_SPIN_US``, ``MLXVLM_NO_MALLOC_TUNING``;
- at load and per operation: ``MLXVLM_NO_CPU_FAST_PATHS`` (everything below off),
  ``MLXVLM_NO_CPU_KERNELS`` (the C++ kernels off, MLX compositions instead),
  ``MLXVLM_CPU_DEQUANTIZE_MAX_GB`` (how many quantized weights may become float32);
- builds (``build_cache``): ``MLXVLM_REBUILD``;
- handed to the C++ kernels once, when ``kernels.load`` imports them, before their first
  call: ``MLXVLM_CPU_ISA`` (caps the instruction set; vector_math.h) and
  ``MLXVLM_HALF_GEMM`` ("own" or "blas": how 16-bit and quantized prefill products
  run; half_linear.cpp). The kernels decide both once per process.
"""

from __future__ import annotations

import functools
import os

NO_OPENBLAS_ENV = "MLXVLM_NO_OPENBLAS"
NO_SHIM_ENV = "MLXVLM_NO_GEMV_FORWARD"
THREADS_ENV = "MLXVLM_CPU_THREADS"
SPIN_ENV = "MLXVLM_CPU_SPIN_US"
NO_MALLOC_TUNING_ENV = "MLXVLM_NO_MALLOC_TUNING"
NO_FAST_PATHS_ENV = "MLXVLM_NO_CPU_FAST_PATHS"
NO_KERNELS_ENV = "MLXVLM_NO_CPU_KERNELS"
DEQUANTIZE_BUDGET_ENV = "MLXVLM_CPU_DEQUANTIZE_MAX_GB"
REBUILD_ENV = "MLXVLM_REBUILD"
ISA_ENV = "MLXVLM_CPU_ISA"
HALF_GEMM_ENV = "MLXVLM_HALF_GEMM"

ISAS = ("avx512", "avx2", "portable")
# How long an idle pool thread spins for the next job before it sleeps (microseconds).
SPIN_US = 1000


def _set(name: str) -> bool:
    """An opt-out variable is set: anything but empty or "0"."""
    return os.environ.get(name, "").strip() not in ("", "0")


def openblas_disabled() -> bool:
    return _set(NO_OPENBLAS_ENV)


def shim_disabled() -> bool:
    return _set(NO_SHIM_ENV)


def malloc_tuning_disabled() -> bool:
    return _set(NO_MALLOC_TUNING_ENV)


def kernels_disabled() -> bool:
    return _set(NO_KERNELS_ENV)


def rebuild_requested() -> bool:
    return _set(REBUILD_ENV)


def cpu_threads() -> int:
    """The threads mlxvlm computes on: ``MLXVLM_CPU_THREADS``, else the CPUs this process
    may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def spin_microseconds() -> int:
    """How long an idle pool thread waits for the next job before it sleeps:
    ``MLXVLM_CPU_SPIN_US`` (0 sleeps at once: for a machine shared with other work)."""
    value = os.environ.get(SPIN_ENV, "").strip()
    # Capped to what a C long holds (the shim treats anything near it as forever).
    return min(int(value), 1 << 62) if value.isdigit() else SPIN_US


def dequantize_budget_bytes() -> int:
    """How many bytes of float32 weights quantized layers may become at load:
    ``MLXVLM_CPU_DEQUANTIZE_MAX_GB`` (decimal GB), else half of the machine's memory."""
    if os.environ.get(DEQUANTIZE_BUDGET_ENV):
        return int(float(os.environ[DEQUANTIZE_BUDGET_ENV]) * 1e9)
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    return total // 2


def isa_cap() -> str:
    """The instruction set ``MLXVLM_CPU_ISA`` caps the kernels at (one of ISAS), or "" for
    no cap (unset, or a value the kernels ignore: see ``isa_cap_ignored``)."""
    cap = os.environ.get(ISA_ENV, "")
    return cap if cap in ISAS else ""


def half_gemm() -> str:
    """``MLXVLM_HALF_GEMM`` as set ("" when unset): "own" or "blas" chooses how prefill's
    16-bit and quantized products run; the kernels say that any other value is ignored."""
    return os.environ.get(HALF_GEMM_ENV, "")


def isa_cap_ignored() -> str | None:
    """The ``MLXVLM_CPU_ISA`` value the kernels ignore (not one of ISAS), or None."""
    cap = os.environ.get(ISA_ENV, "")
    return cap if cap and cap not in ISAS else None


@functools.cache
def _mlx_core():
    # Imported on first use, not at the top: this module is read before mlx.core loads.
    import mlx.core

    return mlx.core


# The on/off rule. Called for every operation that may take a fast path, hence written
# out rather than through the small readers above.
def fast_paths_enabled() -> bool:
    """Whether the CPU backend's fast paths apply: MLX computes on the CPU and
    ``MLXVLM_NO_CPU_FAST_PATHS`` is not set. Metal and CUDA always get plain MLX."""
    mx = _mlx_core()
    return mx.default_device() == mx.cpu and os.environ.get(NO_FAST_PATHS_ENV, "") in ("", "0")


def fast_math_applies(x) -> bool:
    """Whether an operation on ``x`` takes a fast path: the rule above, for float32."""
    return x.dtype == _mlx_core().float32 and fast_paths_enabled()
