"""Which kernels OpenBLAS runs on an x86 CPU, and whether mlxvlm names better ones.

OpenBLAS picks its kernels for the CPU it finds. Releases that predate a CPU fall back
to older ones: an old release takes its AVX2 kernels ("Zen") on an AMD CPU with AVX-512
and its SSE3 ones ("Prescott") on Intel Xeons newer than it, where its AVX-512 kernels
("SkylakeX") run float32 products several times faster. So on x86 mlxvlm asks OpenBLAS,
in child processes (once; the answer is kept in its cache directory), which kernels it
picks by itself and which names it accepts; when its pick is in a lower instruction set
than the CPU's flags allow, ``blas`` names the best kernels the CPU can run to OpenBLAS
as it loads (``OPENBLAS_CORETYPE``, unless the user set it: their choice stands).
``--verbose`` says which kernels run and who chose them (``openblas_core_note``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mlxvlm.cpu.build_cache import cache_dir

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


def openblas_core(library) -> str | None:
    """The kernels OpenBLAS runs (openblas_get_corename), None for another BLAS."""
    try:
        corename = library.openblas_get_corename
    except AttributeError:
        return None
    corename.restype = ctypes.c_char_p
    value = corename()
    return value.decode(errors="replace") if value else None
