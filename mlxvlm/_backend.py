"""Fast paths for MLX's CPU backend, set up before ``mlx.core`` is first imported.

The Linux ``mlx[cpu]`` wheel links the reference BLAS: a float32 256x1536x8960 matmul
takes ~4.9 s on a 2-core x86-64 machine, 0.07 s once the system OpenBLAS is loaded with
RTLD_GLOBAL before libmlx, because libmlx's ``cblas_sgemm`` then resolves to OpenBLAS.
Set ``MLXVLM_NO_OPENBLAS=1`` to opt out.

OpenBLAS picks its kernels for the CPU it finds. Releases that predate a CPU fall back
to older ones: Debian 12's 0.3.21 takes its AVX2 kernels ("Zen") on a Zen 5 EPYC and its
SSE3 ones ("Prescott") on Intel Xeons newer than it (Sapphire, Emerald and Granite
Rapids), where its AVX-512 kernels ("SkylakeX") run float32 products several times
faster. So on x86 mlxvlm asks OpenBLAS, in a child process (once; the answer is kept in
its cache directory), which kernels it picks by itself and which names it accepts; when
its pick is in a lower instruction set than the CPU's flags allow, mlxvlm names the best
kernels the CPU can run to OpenBLAS as it loads (``OPENBLAS_CORETYPE``, unless the user
set it: their choice stands). ``--verbose`` says which kernels run and who chose them.

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
import json
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

# OpenBLAS's x86 kernels (its core names), best first, with the instruction sets each is
# built for: a CPU can run those whose sets it has. SkylakeX's are its AVX-512 float32
# kernels; Cooperlake's add bfloat16 ones and SapphireRapids' AMX, which mlxvlm's float32
# products do not use, but they are what OpenBLAS itself runs where it knows the CPU.
AVX512_CORE = "SkylakeX"
AVX512_CORE_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
AVX2_CORE = "Haswell"
AVX2_CORE_FLAGS = frozenset({"avx", "avx2", "fma"})
_CORES_FOR_FLAGS = (
    ("SapphireRapids", AVX512_CORE_FLAGS | {"avx512_bf16", "avx512_vnni", "avx512_fp16",
                                            "amx_bf16", "amx_tile"}),
    ("Cooperlake", AVX512_CORE_FLAGS | {"avx512_bf16", "avx512_vnni"}),
    (AVX512_CORE, AVX512_CORE_FLAGS),
    (AVX2_CORE, AVX2_CORE_FLAGS),
)
# The instruction sets of OpenBLAS's x86 kernels by core name: 3 AVX-512, 2 AVX2, 1 AVX,
# 0 SSE. A name not here (a newer OpenBLAS's, or another architecture's) is left alone.
_CORE_LEVELS = {
    "SapphireRapids": 3, "Cooperlake": 3, "SkylakeX": 3,
    "Haswell": 2, "Zen": 2,
    "Sandybridge": 1, "Bulldozer": 1, "Piledriver": 1, "Steamroller": 1, "Excavator": 1,
    **dict.fromkeys(("Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom", "Nano",
                     "Opteron", "Opteron_SSE3", "Barcelona", "Bobcat", "Katmai", "Coppermine",
                     "Northwood", "Banias", "Athlon"), 0),
}
_LEVEL_NAMES = {3: "AVX-512", 2: "AVX2"}


def cpu_vendor_and_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """The first CPU's vendor id and the instruction sets the kernel enabled for it
    ("", {} when unknown; an Arm CPU's "Features" are not x86 flags and give {})."""
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


def openblas_cores_for(flags) -> list[str]:
    """OpenBLAS's kernels this CPU can run, best first, among those worth naming to it
    (none on a CPU without AVX2 and FMA, or not x86)."""
    return [core for core, needs in _CORES_FOR_FLAGS if needs <= set(flags)]


def _level(core: str | None) -> int | None:
    return _CORE_LEVELS.get(core) if core else None


def openblas_core_choice(environ, flags, default: str | None, accepted) -> str | None:
    """The kernels to name to OpenBLAS, or None to leave it its own choice.

    default: the kernels OpenBLAS picks by itself here (None: unknown); accepted: the
    names this OpenBLAS build takes (a probe's answer). A release older than the CPU
    falls back to older kernels, e.g. SSE3 ("Prescott") on an Intel Xeon it does not
    know, or AVX2 on an AMD CPU with AVX-512. mlxvlm then names the best kernels the
    CPU's flags allow and the build has, in a higher instruction set than OpenBLAS's own
    pick; never over the user's OPENBLAS_CORETYPE, and never over a pick it cannot rank.
    """
    if environ.get("OPENBLAS_CORETYPE", "").strip():
        return None
    own = _level(default)
    if own is None:
        return None
    for core in openblas_cores_for(flags):
        if core in accepted and _CORE_LEVELS[core] > own:
            return core
    return None


def openblas_core_note(core: str, environ, flags, *, forced: str | None = None,
                       default: str | None = None) -> str:
    """What --verbose says of OpenBLAS's kernels: who chose them, and faster ones the
    CPU has that stay unused (under the user's OPENBLAS_CORETYPE, or missing from the
    build)."""
    best = openblas_cores_for(flags)
    cpu_level = _CORE_LEVELS[best[0]] if best else None
    has = _LEVEL_NAMES.get(cpu_level, "")
    if forced is not None:
        return (f", {core} kernels (chosen by mlxvlm: OpenBLAS picks {default} on this "
                f"{has} CPU; set OPENBLAS_CORETYPE to choose others)")
    level = _level(core)
    if level is None or cpu_level is None or level >= cpu_level:
        return f", {core} kernels"
    user_choice = environ.get("OPENBLAS_CORETYPE", "").strip()
    if user_choice:
        better = AVX512_CORE if cpu_level == 3 else AVX2_CORE
        return (f", {core} kernels (OPENBLAS_CORETYPE={user_choice}; this CPU has {has}: "
                f"OPENBLAS_CORETYPE={better} runs float32 products faster)")
    return f", {core} kernels (this CPU has {has}, which this OpenBLAS build has no kernels for)"


_PROBE = (
    "import ctypes, sys\n"
    "name = ctypes.CDLL(sys.argv[1]).openblas_get_corename\n"
    "name.restype = ctypes.c_char_p\n"
    "print((name() or b'').decode(errors='replace'))\n"
)


def _corenames_in_children(library: str, coretypes) -> list[str | None]:
    """openblas_get_corename() of OpenBLAS loaded in a fresh process for each coretype
    (None: OPENBLAS_CORETYPE unset), run side by side. OpenBLAS reads the variable once,
    as it loads, so each choice needs a process of its own; None where one failed."""
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    base["OPENBLAS_NUM_THREADS"] = "1"  # it starts no threads it would not use
    children = []
    for coretype in coretypes:
        env = dict(base, **({"OPENBLAS_CORETYPE": coretype} if coretype else {}))
        try:
            children.append(subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _PROBE, library], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        except OSError:
            children.append(None)
    names = []
    for child in children:
        try:
            out, _ = child.communicate(timeout=60) if child else ("", None)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            out = ""
        names.append(out.strip() if child and child.returncode == 0 and out.strip() else None)
    return names


def _probe_cache(library: str, flags) -> Path:
    """Where a probe's answer is kept: one file per library, CPU and loader state (an
    upgraded OpenBLAS is installed through ldconfig, which rewrites /etc/ld.so.cache)."""
    try:
        loader = os.stat("/etc/ld.so.cache").st_mtime_ns
    except OSError:
        loader = 0
    key = json.dumps([library, os.environ.get("LD_LIBRARY_PATH", ""), loader, sorted(flags),
                      sys.platform])
    return cache_dir() / f"openblas-cores-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def probe_openblas_cores(library: str, flags) -> tuple[str | None, frozenset[str]]:
    """The kernels OpenBLAS picks by itself on this CPU, and which of those the CPU can
    run (openblas_cores_for) the build accepts, asked of child processes once and kept
    in mlxvlm's cache directory."""
    cache = _probe_cache(library, flags)
    try:
        known = json.loads(cache.read_text())
        return known["default"], frozenset(known["accepted"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    candidates = openblas_cores_for(flags)
    default = _corenames_in_children(library, [None])[0]
    accepted: frozenset[str] = frozenset()
    own = _level(default)
    asked = [core for core in candidates if own is not None and _CORE_LEVELS[core] > own]
    if asked:  # only when OpenBLAS's own pick is below what the CPU can run
        accepted = frozenset(core for core, got in zip(asked, _corenames_in_children(library, asked))
                             if got == core)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache.parent, delete=False) as f:
            json.dump({"default": default, "accepted": sorted(accepted)}, f)
        os.replace(f.name, cache)  # atomic: a concurrent process reads all or nothing
    except OSError:
        pass
    return default, accepted


def _open_openblas(name: str, flags):
    """dlopen OpenBLAS (RTLD_GLOBAL), naming its kernels where openblas_core_choice says
    so; OpenBLAS reads OPENBLAS_CORETYPE as it loads, and the variable is taken back
    afterwards so that other programs and libraries see the user's environment. Returns
    the library and the kernels OpenBLAS picks by itself (None when not probed)."""
    global openblas_core_forced
    if os.environ.get("OPENBLAS_CORETYPE", "").strip() or not openblas_cores_for(flags):
        return ctypes.CDLL(name, mode=os.RTLD_GLOBAL), None
    default, accepted = probe_openblas_cores(name, flags)
    core = openblas_core_choice(os.environ, flags, default, accepted)
    if core is None:
        return ctypes.CDLL(name, mode=os.RTLD_GLOBAL), default
    os.environ["OPENBLAS_CORETYPE"] = core
    try:
        library = ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
    finally:
        del os.environ["OPENBLAS_CORETYPE"]
    openblas_core_forced = core
    return library, default


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
    _, flags = cpu_vendor_and_flags()
    try:
        openblas, default = _open_openblas(name, flags)
    except OSError as exc:
        openblas_status = f"failed to load {name}: {exc}"
        if shim is not None:  # uninitialised, it passes every product on (RTLD_NEXT)
            gemv_forward_status = "not used: OpenBLAS did not load"
        return
    openblas_status = f"loaded {name}"
    core = openblas_core(openblas)
    if core is not None:
        if default is not None and core != (openblas_core_forced or default):
            # A kept probe that no longer holds (another OpenBLAS under the same name):
            # the next process asks again.
            _probe_cache(name, flags).unlink(missing_ok=True)
        openblas_status += openblas_core_note(core, os.environ, flags,
                                              forced=openblas_core_forced, default=default)
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
