"""Fast paths for MLX's CPU backend, set up before ``mlx.core`` is first imported.

The Linux ``mlx[cpu]`` wheel links the reference BLAS: a float32 256x1536x8960 matmul
takes ~4.9 s on a 2-core x86-64 machine, 0.07 s once the system OpenBLAS is loaded with
RTLD_GLOBAL before libmlx, because libmlx's ``cblas_sgemm`` then resolves to OpenBLAS.
Set ``MLXVLM_NO_OPENBLAS=1`` to opt out.

With it, a small shim (``_blas_shim.c``, compiled once with the system C compiler and
cached) holds mlxvlm's CPU threads and takes every float32 product of the process
(libmlx's ``cblas_sgemm`` and the CPU kernels'):
- one pool of threads (``MLXVLM_CPU_THREADS``, default: the CPUs this process may use)
  runs the CPU kernels and the products, OpenBLAS single-threaded inside each part, so
  that no idle OpenBLAS worker spins next to the kernels; the pool's threads spin
  briefly between jobs before they sleep (see the C file);
- one-row and one-column products (every matmul of a decoding step) go to OpenBLAS's
  ``sgemv``, which streams the weights about 3x faster than its ``sgemm`` does for them.
Without a compiler the shim is skipped and said so, OpenBLAS keeps its own threads and
the kernels their own pool; ``MLXVLM_NO_GEMV_FORWARD=1`` opts out of the shim alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# glibc's malloc thresholds (bytes) mlxvlm sets on Linux: see tune_malloc.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
malloc_status: str = "not attempted"

# What happened, for --verbose: the library path loaded, or why none was.
openblas_status: str = "not attempted"
gemv_forward_status: str = "not attempted"
# The loaded shim (mlxvlm_gemv_forwarded() counts the products it forwarded to sgemv,
# mlxvlm_products_split() those it split over the pool, mlxvlm_pool_jobs() the jobs its
# pool ran, the CPU kernels' included, mlxvlm_pool_sleeps() the times an idle thread
# went to sleep), or None.
gemv_forward = None
# The shim's pool size (the kernels use it too); 1 when there is no shim.
pool_threads: int = 1
# How long an idle pool thread spins for the next job before it sleeps (microseconds).
SPIN_US = 1000

_SHIM_SOURCE = Path(__file__).with_name("_blas_shim.c")


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mlxvlm"


def _build_shim() -> Path:
    """The compiled shim, built on first use into the user's cache directory."""
    source = _SHIM_SOURCE.read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (cc/gcc; set CC)")
    digest = hashlib.sha256(source + compiler.encode()).hexdigest()[:16]
    target = cache_dir() / f"libmlxvlm_blas_shim-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", str(_SHIM_SOURCE), "-o", str(built), "-ldl",
             "-lpthread"],
            capture_output=True, text=True, timeout=120,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-300:]}")
        os.replace(built, target)  # atomic: a concurrent process sees all or nothing
    return target


def _load_shim():
    """Build and load the shim (RTLD_GLOBAL, ahead of OpenBLAS); None when skipped."""
    global gemv_forward_status
    if os.environ.get("MLXVLM_NO_GEMV_FORWARD", "").strip() not in ("", "0"):
        gemv_forward_status = "disabled by MLXVLM_NO_GEMV_FORWARD"
        return None
    try:
        return ctypes.CDLL(str(_build_shim()), mode=os.RTLD_GLOBAL)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        gemv_forward_status = f"not used: {exc}"
        return None


def cpu_threads() -> int:
    """The threads mlxvlm computes on: ``MLXVLM_CPU_THREADS``, else the CPUs this process
    may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    value = os.environ.get("MLXVLM_CPU_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def spin_microseconds() -> int:
    """How long an idle pool thread waits for the next job before it sleeps:
    ``MLXVLM_CPU_SPIN_US`` (0 sleeps at once: for a machine shared with other work)."""
    value = os.environ.get("MLXVLM_CPU_SPIN_US", "").strip()
    return int(value) if value.isdigit() else SPIN_US


def preload_openblas() -> None:
    global openblas_status, gemv_forward_status, gemv_forward, pool_threads
    if sys.platform == "darwin":
        openblas_status = "not used on macOS (Accelerate/Metal)"
        return
    if os.environ.get("MLXVLM_NO_OPENBLAS", "").strip() not in ("", "0"):
        openblas_status = "disabled by MLXVLM_NO_OPENBLAS"
        return
    if "mlx.core" in sys.modules:
        openblas_status = "skipped: mlx.core was imported before mlxvlm"
        return
    name = ctypes.util.find_library("openblas")
    if name is None:
        openblas_status = (
            "not found (install it for ~10x faster CPU matmuls, "
            "e.g. `apt-get install libopenblas0-pthread`)"
        )
        return
    shim = _load_shim()  # first, so that libmlx's cblas_sgemm resolves to it
    try:
        openblas = ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
    except OSError as exc:
        openblas_status = f"failed to load {name}: {exc}"
        if shim is not None:  # uninitialised, it passes every product on (RTLD_NEXT)
            gemv_forward_status = "not used: OpenBLAS did not load"
        return
    openblas_status = f"loaded {name}"
    if shim is not None:
        address = lambda symbol: ctypes.cast(getattr(openblas, symbol), ctypes.c_void_p)  # noqa: E731
        threads = cpu_threads()
        try:
            openblas.openblas_set_num_threads(1)  # the pool's threads call it, one each
            single_threaded = True
        except AttributeError:  # a BLAS without OpenBLAS's thread control threads itself
            single_threaded = False
        split = single_threaded and threads > 1
        shim.mlxvlm_blas_init(address("cblas_sgemm"), address("cblas_sgemv"), threads,
                              int(split), ctypes.c_long(spin_microseconds()))
        shim.mlxvlm_gemv_forwarded.restype = ctypes.c_long
        shim.mlxvlm_products_split.restype = ctypes.c_long
        shim.mlxvlm_pool_jobs.restype = ctypes.c_long
        shim.mlxvlm_pool_sleeps.restype = ctypes.c_long
        gemv_forward, pool_threads = shim, threads
        if split:
            products = f"products split over mlxvlm's {threads} threads, OpenBLAS single-threaded"
        elif single_threaded:
            products = "products on one thread"
        else:
            products = "the BLAS threads the products itself"
        gemv_forward_status = f"one-row and one-column float32 products use OpenBLAS's sgemv; {products}"


def tune_malloc() -> None:
    """Keep freed activations in the process for the next operation to reuse.

    MLX's CPU allocator takes each operation's output from malloc and frees it when the
    array dies. With glibc's defaults a freed block of more than a few MB goes back to
    the kernel (munmap, or a trimmed arena heap), and the next one is faulted in again,
    page by page, zeroed: ~73,000 page faults per SmolVLM vision tower (300 MB). With
    blocks below 32 MB kept in malloc's arenas and up to 128 MB of free memory kept at
    their top, a second tower takes none. Set MLXVLM_NO_MALLOC_TUNING=1 to opt out.
    """
    global malloc_status
    if not sys.platform.startswith("linux"):
        malloc_status = "not used (glibc's malloc only)"
        return
    if os.environ.get("MLXVLM_NO_MALLOC_TUNING", "").strip() not in ("", "0"):
        malloc_status = "disabled by MLXVLM_NO_MALLOC_TUNING"
        return
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc: another libc's mallopt numbers differ
    except AttributeError:
        malloc_status = "not used (not glibc)"
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        malloc_status = (f"blocks under {MMAP_THRESHOLD >> 20} MB reused, "
                         f"up to {TRIM_THRESHOLD >> 20} MB of free memory kept")
    else:
        malloc_status = "mallopt refused the thresholds"
