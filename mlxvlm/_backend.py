"""Fast paths for MLX's CPU backend, set up before ``mlx.core`` is first imported.

The Linux ``mlx[cpu]`` wheel links the reference BLAS: a float32 256x1536x8960 matmul
takes ~4.9 s on a 2-core x86-64 machine, 0.07 s once the system OpenBLAS is loaded with
RTLD_GLOBAL before libmlx, because libmlx's ``cblas_sgemm`` then resolves to OpenBLAS.
Set ``MLXVLM_NO_OPENBLAS=1`` to opt out.

OpenBLAS picks its kernels for the CPU it finds. Releases that predate a CPU take its
AVX2 kernels ("Haswell", "Zen") on AMD CPUs with AVX-512 (Zen 4, Zen 5): Debian 12's
0.3.21 does so on a Zen 5 EPYC, where its AVX-512 kernels ("SkylakeX") run a float32
sgemm 1.8-1.9x faster. On such a CPU mlxvlm names those kernels to OpenBLAS as it loads
(``OPENBLAS_CORETYPE``, unless the user set it: their choice stands).

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
# How long an idle pool thread spins for the next job before it sleeps (microseconds).
SPIN_US = 1000

_SHIM_SOURCE = Path(__file__).with_name("_blas_shim.c")

# OpenBLAS's AVX-512 kernels, and the instruction sets they need (OpenBLAS's SkylakeX).
AVX512_CORE = "SkylakeX"
AVX512_CORE_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})


def cpu_vendor_and_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """The first CPU's vendor id and the instruction sets the kernel enabled for it
    ("", {} when unknown)."""
    vendor, flags = "", frozenset()
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return vendor, flags


def openblas_core_choice(environ, vendor: str, flags) -> str | None:
    """The kernels to name to OpenBLAS, or None to leave it its own choice: its AVX-512
    kernels on an AMD CPU with AVX-512, which releases older than the CPU do not pick;
    never over the user's OPENBLAS_CORETYPE."""
    if environ.get("OPENBLAS_CORETYPE", "").strip():
        return None
    if vendor == "AuthenticAMD" and AVX512_CORE_FLAGS <= set(flags):
        return AVX512_CORE
    return None


# OpenBLAS's kernels without AVX-512, which such a CPU may be told or left to run.
_PRE_AVX512_CORES = frozenset({"Haswell", "Zen", "Sandybridge"})


def openblas_core_note(core: str, forced: str | None, environ, flags) -> str:
    """What --verbose says of OpenBLAS's kernels: who chose them, and the faster ones a
    user's OPENBLAS_CORETYPE leaves unused on an AVX-512 CPU."""
    if forced is not None:
        return (f", {core} kernels (chosen by mlxvlm for this AVX-512 AMD CPU; "
                "set OPENBLAS_CORETYPE to choose others)")
    user_choice = environ.get("OPENBLAS_CORETYPE", "").strip()
    if user_choice and core in _PRE_AVX512_CORES and AVX512_CORE_FLAGS <= set(flags):
        return (f", {core} kernels (OPENBLAS_CORETYPE={user_choice}; this CPU has "
                f"AVX-512: OPENBLAS_CORETYPE={AVX512_CORE} runs float32 products up to "
                "~1.9x faster)")
    return f", {core} kernels"


def _open_openblas(name: str, vendor: str, flags):
    """dlopen OpenBLAS (RTLD_GLOBAL), naming its kernels where openblas_core_choice says
    so; OpenBLAS reads OPENBLAS_CORETYPE as it loads, and the variable is taken back
    afterwards so that other programs and libraries see the user's environment."""
    global openblas_core_forced
    core = openblas_core_choice(os.environ, vendor, flags)
    if core is None:
        return ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
    os.environ["OPENBLAS_CORETYPE"] = core
    try:
        library = ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
    finally:
        del os.environ["OPENBLAS_CORETYPE"]
    openblas_core_forced = core
    return library


def openblas_core(library) -> str | None:
    """The kernels OpenBLAS runs (openblas_get_corename), None for another BLAS."""
    try:
        corename = library.openblas_get_corename
    except AttributeError:
        return None
    corename.restype = ctypes.c_char_p
    value = corename()
    return value.decode(errors="replace") if value else None


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
    # Capped to what a C long holds (the shim treats anything near it as forever).
    return min(int(value), 1 << 62) if value.isdigit() else SPIN_US


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
    vendor, flags = cpu_vendor_and_flags()
    try:
        openblas = _open_openblas(name, vendor, flags)
    except OSError as exc:
        openblas_status = f"failed to load {name}: {exc}"
        if shim is not None:  # uninitialised, it passes every product on (RTLD_NEXT)
            gemv_forward_status = "not used: OpenBLAS did not load"
        return
    openblas_status = f"loaded {name}"
    core = openblas_core(openblas)
    if core is not None:
        openblas_status += openblas_core_note(core, openblas_core_forced, os.environ, flags)
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
        shim.mlxvlm_pool_spun.restype = ctypes.c_long
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
