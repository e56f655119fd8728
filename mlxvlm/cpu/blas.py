"""The BLAS under MLX's CPU backend, set up before ``mlx.core`` is first imported.

The Linux ``mlx[cpu]`` wheel links the reference BLAS, many times slower than OpenBLAS
for float32 products. Loading the system OpenBLAS with RTLD_GLOBAL before libmlx makes
libmlx's ``cblas_sgemm`` resolve to it. ``MLXVLM_NO_OPENBLAS=1`` opts out. On x86,
``openblas_cores`` decides whether OpenBLAS is told which kernels to run.

With it, a small shim (``blas_shim.c``, compiled once with the system C compiler and
cached: ``shim_build``) holds mlxvlm's CPU threads and takes every float32 product of
the process (libmlx's ``cblas_sgemm`` and the CPU kernels'):
- one pool of threads (``MLXVLM_CPU_THREADS``, default: the CPUs this process may use)
  runs the CPU kernels and the products, OpenBLAS single-threaded inside each part, so
  that no idle OpenBLAS worker spins next to the kernels; the pool's threads spin
  briefly between jobs before they sleep (``MLXVLM_CPU_SPIN_US``; see the C file);
- one-row and one-column products (every matmul of a decoding step) go to OpenBLAS's
  ``sgemv``, which streams the weights faster than its ``sgemm`` does for them.
Without a compiler the shim is skipped and said so, OpenBLAS keeps its own threads and
the kernels their own pool; ``MLXVLM_NO_GEMV_FORWARD=1`` opts out of the shim alone.

Nothing here imports MLX: ``mlxvlm/process_setup.py`` calls ``preload_openblas`` just
before MLX's first import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
import warnings

# Modules, not their names: their functions are looked up at each call (a test replaces
# openblas_cores.probe_openblas_cores).
from mlxvlm.cpu import openblas_cores, policy, shim_build

IMPORTED_AFTER_MLX = (
    "mlxvlm was imported after mlx.core, too late to put OpenBLAS and mlxvlm's CPU threads "
    "under MLX: float32 matrix products in this process run several times slower. Import "
    "mlxvlm before mlx (or mlx_lm) to have them.")

# What happened, for --verbose: the library path loaded, or why none was.
openblas_status: str = "not attempted"
# The kernels mlxvlm named to OpenBLAS (see openblas_core_choice), or None.
openblas_core_forced: str | None = None
gemv_forward_status: str = "not attempted"
# The loaded shim (mlxvlm_gemv_forwarded() counts the products it forwarded to sgemv,
# mlxvlm_products_split() those it split over the pool, mlxvlm_pool_jobs() the jobs its
# pool ran, the CPU kernels' included, mlxvlm_pool_sleeps() the times an idle thread
# went to sleep, mlxvlm_pool_spun() the times one found its next job while it spun), or
# None.
gemv_forward = None
# The shim's pool size (the kernels use it too); 1 when there is no shim.
pool_threads: int = 1


def _open_openblas(name: str, flags):
    """dlopen OpenBLAS (RTLD_GLOBAL), naming its kernels where openblas_core_choice says
    so; OpenBLAS reads OPENBLAS_CORETYPE as it loads, and the variable is taken back
    afterwards so that other programs and libraries see the user's environment. Returns
    the library and the kernels OpenBLAS picks by itself (None when not probed)."""
    global openblas_core_forced
    cores = openblas_cores
    if os.environ.get("OPENBLAS_CORETYPE", "").strip() or not cores.openblas_cores_for(flags):
        return ctypes.CDLL(name, mode=os.RTLD_GLOBAL), None
    default, accepted = cores.probe_openblas_cores(name, flags)
    core = cores.openblas_core_choice(os.environ, flags, default, accepted)
    if core is None:
        return ctypes.CDLL(name, mode=os.RTLD_GLOBAL), default
    os.environ["OPENBLAS_CORETYPE"] = core
    try:
        library = ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
    finally:
        del os.environ["OPENBLAS_CORETYPE"]
    openblas_core_forced = core
    return library, default


def _load_shim():
    """Build and load the shim (RTLD_GLOBAL, ahead of OpenBLAS); None when skipped."""
    global gemv_forward_status
    if policy.shim_disabled():
        gemv_forward_status = f"disabled by {policy.NO_SHIM_ENV}"
        return None
    try:
        return ctypes.CDLL(str(shim_build.build_shim()), mode=os.RTLD_GLOBAL)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        gemv_forward_status = f"not used: {exc}"
        return None


def preload_openblas() -> None:
    global openblas_status, gemv_forward_status, gemv_forward, pool_threads
    if sys.platform == "darwin":
        openblas_status = "not used on macOS (Accelerate/Metal)"
        return
    if policy.openblas_disabled():
        openblas_status = f"disabled by {policy.NO_OPENBLAS_ENV}"
        return
    if "mlx.core" in sys.modules:
        openblas_status = "skipped: mlx.core was imported before mlxvlm"
        # Said once, where a script's author sees it: the reference BLAS stays under
        # every float32 product of this process, several times slower.
        warnings.warn(IMPORTED_AFTER_MLX, RuntimeWarning, stacklevel=2)
        return
    name = ctypes.util.find_library("openblas")
    if name is None:
        openblas_status = (
            "not found (install it for ~10x faster CPU matmuls, "
            "e.g. `apt-get install libopenblas0-pthread`)"
        )
        return
    shim = _load_shim()  # first, so that libmlx's cblas_sgemm resolves to it
    _, flags = openblas_cores.cpu_vendor_and_flags()
    try:
        openblas, default = _open_openblas(name, flags)
    except OSError as exc:
        openblas_status = f"failed to load {name}: {exc}"
        if shim is not None:  # uninitialised, it passes every product on (RTLD_NEXT)
            gemv_forward_status = "not used: OpenBLAS did not load"
        return
    openblas_status = f"loaded {name}"
    core = openblas_cores.openblas_core(openblas)
    if core is not None:
        if default is not None and core != (openblas_core_forced or default):
            # A kept probe that no longer holds (another OpenBLAS under the same name):
            # the next process asks again.
            openblas_cores._probe_cache(name, flags).unlink(missing_ok=True)
        openblas_status += openblas_cores.openblas_core_note(
            core, os.environ, flags, forced=openblas_core_forced, default=default)
    if shim is not None:
        address = lambda symbol: ctypes.cast(getattr(openblas, symbol), ctypes.c_void_p)  # noqa: E731
        threads = policy.cpu_threads()
        try:
            openblas.openblas_set_num_threads(1)  # the pool's threads call it, one each
            single_threaded = True
        except AttributeError:  # a BLAS without OpenBLAS's thread control threads itself
            single_threaded = False
        split = single_threaded and threads > 1
        shim.mlxvlm_blas_init(address("cblas_sgemm"), address("cblas_sgemv"), threads,
                              int(split), ctypes.c_long(policy.spin_microseconds()))
        shim.mlxvlm_gemv_forwarded.restype = ctypes.c_long
        shim.mlxvlm_products_split.restype = ctypes.c_long
        shim.mlxvlm_pool_jobs.restype = ctypes.c_long
        shim.mlxvlm_pool_sleeps.restype = ctypes.c_long
        shim.mlxvlm_pool_spun.restype = ctypes.c_long
        gemv_forward, pool_threads = shim, threads
        if split:
            products = f"products split over mlxvlm's {threads} threads, OpenBLAS single-threaded"
        elif single_threaded:
            products = "products on one thread"
        else:
            products = "the BLAS threads the products itself"
        gemv_forward_status = f"one-row and one-column float32 products use OpenBLAS's sgemv; {products}"
