"""Compile the CPU kernels (``*.cpp`` here) into an MLX extension module, once per
machine, source and MLX version, into the user's cache directory.

An MLX extension is C++ compiled against the installed ``mlx`` (its headers and
``libmlx``) and bound with nanobind in MLX's nanobind domain, so that ``mlx.core.array``
passes through (see MLX's "Custom Extensions" documentation). It needs a C++17 compiler,
Python's headers and the ``nanobind`` package; without them the kernels are skipped and
``mlxvlm.cpu.kernels.status`` says why.

The build runs at first use rather than at install time: it must compile against the
``mlx`` that runs (its headers and ``libmlx``), which an isolated install-time build
environment need not have, and an MLX upgrade must trigger a new build without a
reinstall of mlxvlm. It is made cheap to fail instead: one build at a time per machine,
and a failed one remembered under its fingerprint (``mlxvlm.cpu.build_cache``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlxvlm.cpu.build_cache import (
    BuildError,
    build_once,
    cache_dir,
    compiler_version,
    fingerprint,
)

MODULE_NAME = "_mlxvlm_cpu_kernels"
SOURCE_DIR = Path(__file__).parent
SOURCES = tuple(sorted(p.name for p in SOURCE_DIR.glob("*.cpp")))
HEADERS = tuple(sorted(p.name for p in SOURCE_DIR.glob("*.h")))
# nanobind 3.x: the ABI (internals v22) of the nanobind that mlx.core is built with.
NANOBIND_REQUIREMENT = "nanobind>=3,<4"


def _toolchain() -> dict:
    import mlx.core as mx

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None or shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler found ({compiler or 'c++/g++'}; set CXX)")
    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").exists():
        raise BuildError(f"Python's headers are missing ({python_include}/Python.h; "
                         "e.g. apt-get install python3-dev)")
    if importlib.util.find_spec("nanobind") is None:
        raise BuildError(f"the nanobind package is missing (pip install '{NANOBIND_REQUIREMENT}')")
    import nanobind

    if not nanobind.__version__.startswith("3."):
        raise BuildError(f"nanobind {nanobind.__version__} found; MLX needs {NANOBIND_REQUIREMENT}")
    mlx_root = Path(mx.__file__).resolve().parent
    return {
        "compiler": compiler,
        "python_include": python_include,
        "nanobind": Path(nanobind.include_dir()).parent,
        "nanobind_version": nanobind.__version__,
        "mlx_include": mlx_root / "include",
        "mlx_lib": mlx_root / "lib",
        "mlx_version": mx.__version__,
    }


def _fingerprint(tools: dict) -> str:
    """Everything the extension's binary depends on: its sources, the compiler (path and
    version), Python, nanobind, and the MLX it links (version and install path: two
    environments with the same MLX version still link different ``libmlx`` files)."""
    return fingerprint(
        [SOURCE_DIR / name for name in SOURCES + HEADERS],
        tools["compiler"], compiler_version(tools["compiler"]), tools["python_include"],
        tools["nanobind_version"], tools["mlx_version"], tools["mlx_lib"], sys.version,
    )


def _compile(tools: dict, source: Path, obj: Path, *, nanobind_itself: bool) -> None:
    nanobind = tools["nanobind"]
    command = [
        tools["compiler"], "-std=c++20", "-O3", "-DNDEBUG", "-fPIC", "-fvisibility=hidden",
        "-fno-strict-aliasing", "-DNB_DOMAIN=mlx",
        f"-I{tools['python_include']}", f"-I{nanobind / 'include'}",
        "-c", str(source), "-o", str(obj),
    ]
    if nanobind_itself:
        command[-4:-4] = ["-DNB_BUILD", "-DNB_COMPACT_ASSERTIONS",
                          f"-I{nanobind / 'ext' / 'robin_map' / 'include'}"]
    else:
        command[-4:-4] = ["-isystem", str(tools["mlx_include"])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise BuildError(f"compiling {source.name} failed: {result.stderr.strip()[-600:]}")


def build(verbose: bool = False) -> Path:
    """The compiled extension's path, building it first if it is not in the cache.

    Raises ``BuildError`` when the toolchain is missing, when this fingerprint's build
    failed before (at once, without compiling again), or when the build fails now."""
    tools = _toolchain()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target_dir = cache_dir() / f"cpu-kernels-{_fingerprint(tools)}"
    target = target_dir / f"{MODULE_NAME}{suffix}"

    def announce() -> None:
        if verbose:
            print("mlxvlm: compiling the CPU kernels (once)...", file=sys.stderr, flush=True)

    return build_once(target_dir, target, lambda: _compile_and_link(tools, target_dir, target),
                      "sources and toolchain", announce)


def _compile_and_link(tools: dict, target_dir: Path, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target_dir.parent) as tmp:
        tmp = Path(tmp)
        jobs = [(SOURCE_DIR / name, tmp / f"{Path(name).stem}.o", False) for name in SOURCES]
        jobs.append((tools["nanobind"] / "src" / "nb_combined.cpp", tmp / "nanobind.o", True))
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            for future in [pool.submit(_compile, tools, s, o, nanobind_itself=n) for s, o, n in jobs]:
                future.result()
        built = tmp / target.name
        link = [
            tools["compiler"], "-shared", "-o", str(built), *(str(o) for _, o, _ in jobs),
            f"-L{tools['mlx_lib']}", "-lmlx", f"-Wl,-rpath,{tools['mlx_lib']}",
        ]
        result = subprocess.run(link, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise BuildError(f"linking failed: {result.stderr.strip()[-600:]}")
        staged = tmp / "staged"
        staged.mkdir()
        os.replace(built, staged / target.name)
        if target_dir.exists():  # an empty or partial directory left by a killed build
            shutil.rmtree(target_dir)
        os.replace(staged, target_dir)  # atomic: a process not holding the lock sees all or nothing
