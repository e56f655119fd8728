"""What every compiled-on-first-use artefact (the CPU kernels, the BLAS shim) shares: one
build at a time per machine, a failed build remembered, and a fingerprint of everything
the build depends on.

A build that fails is remembered under its fingerprint, so that later processes skip it
at once instead of compiling again: a change of source, compiler, MLX or Python gives a
new fingerprint and so a new try, and ``MLXVLM_REBUILD=1`` forces one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

from mlxvlm.cpu import policy

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialised, the atomic rename still holds
    fcntl = None

REBUILD_ENV = policy.REBUILD_ENV


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mlxvlm"


@functools.cache
def compiler_version(compiler: str) -> str:
    """The compiler's own ``--version`` line: a compiler upgraded under the same path
    must not reuse objects built by the old one.

    Asked of the compiler once per installed binary (its resolved path, size and
    modification time) and kept in the cache directory: the BLAS shim's build checks
    its fingerprint in every process that loads MLX after mlxvlm, which should not start
    a process."""
    try:
        binary = Path(shutil.which(compiler) or compiler).resolve()
        info = binary.stat()
    except OSError:
        return _ask_version(compiler)
    key = json.dumps([compiler, str(binary), info.st_size, info.st_mtime_ns])
    kept = cache_dir() / "compilers" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.txt"
    try:
        return kept.read_text(encoding="utf-8")
    except OSError:
        pass
    version = _ask_version(compiler)
    if not version.startswith("unknown"):
        with contextlib.suppress(OSError):
            kept.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=kept.parent, delete=False,
                                             encoding="utf-8") as f:
                f.write(version)
            os.replace(f.name, kept)  # atomic: a concurrent process reads all or nothing
    return version


def _ask_version(compiler: str) -> str:
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return (result.stdout.splitlines() or ["unknown"])[0]


def fingerprint(files: Iterable[Path], *facts: object) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
    for fact in facts:
        digest.update(b"\0" + str(fact).encode())
    return digest.hexdigest()[:16]


def _failure_file(target: Path) -> Path:
    return target.parent / f"{target.name}.failed"


@contextlib.contextmanager
def exclusive(target: Path) -> Iterator[None]:
    """Hold the build lock of ``target``: processes starting together wait for the first
    one's build instead of each compiling."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def previous_failure(target: Path) -> str | None:
    """Why the last build of ``target`` (this fingerprint) failed, unless a rebuild is
    asked for."""
    if policy.rebuild_requested():
        return None
    try:
        return _failure_file(target).read_text(encoding="utf-8")
    except OSError:
        return None


def remember_failure(target: Path, message: str) -> None:
    with contextlib.suppress(OSError):
        _failure_file(target).write_text(message, encoding="utf-8")


def forget_failure(target: Path) -> None:
    with contextlib.suppress(OSError):
        _failure_file(target).unlink()


def build_once(key: Path, product: Path, make: Callable[[], None], what: str,
               announce: Callable[[], None] | None = None) -> Path:
    """``product``, made by ``make()`` unless it exists: under ``key``'s lock, and not
    again after a failure remembered under ``key`` (``what`` names the inputs in that
    error); ``announce()`` runs just before a build starts. Raises ``BuildError``."""
    if product.exists():
        return product
    with exclusive(key):
        if product.exists():  # built by the process that held the lock before us
            return product
        failure = previous_failure(key)
        if failure is not None:
            raise BuildError(f"{failure} (an earlier build with the same {what}; "
                             f"{policy.REBUILD_ENV}=1 tries again)")
        if announce is not None:
            announce()
        try:
            make()
        except (BuildError, OSError, subprocess.SubprocessError) as exc:
            remember_failure(key, str(exc))
            raise BuildError(str(exc)) from exc
        forget_failure(key)
    return product
