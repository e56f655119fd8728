"""Compile the BLAS shim (``blas_shim.c``) with the system C compiler, once per machine,
source and compiler, into the user's cache directory.

Like the kernels' build (``kernels/build.py``) it goes through ``build_cache``: one build
at a time per machine (processes starting together wait for the first one's), a failed
build remembered under its fingerprint (later processes skip it at once instead of
compiling again at every import; ``MLXVLM_REBUILD=1`` tries again), and a fingerprint of
the source, the compiler's path and the compiler's own version.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from mlxvlm.cpu.build_cache import (
    BuildError,
    build_once,
    cache_dir,
    compiler_version,
    fingerprint,
)

SOURCE = Path(__file__).with_name("blas_shim.c")


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise BuildError("no C compiler found (cc/gcc; set CC)")
    return compiler


def target_path(compiler: str) -> Path:
    digest = fingerprint([SOURCE], compiler, compiler_version(compiler))
    return cache_dir() / f"libmlxvlm_blas_shim-{digest}.so"


def build_shim() -> Path:
    """The compiled shim's path, building it first if it is not in the cache.

    Raises ``BuildError`` without a compiler, when this fingerprint's build failed
    before (at once), or when the build fails now."""
    compiler = _compiler()
    target = target_path(compiler)
    return build_once(target, target, lambda: _compile(compiler, target),
                      "source and compiler")


def _compile(compiler: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", str(SOURCE), "-o", str(built), "-ldl",
             "-lpthread"],
            capture_output=True, text=True, timeout=120,
        )
        if result.returncode != 0:
            raise BuildError(f"{compiler} failed: {result.stderr.strip()[-300:]}")
        os.replace(built, target)  # atomic: a concurrent process sees all or nothing
