"""The BLAS shim's build (mlxvlm/cpu/shim_build.py): cheap to fail, one at a time, keyed
by its source and the compiler's own version, like the kernels' (test_kernel_build.py)."""

from __future__ import annotations

import fcntl
import shutil

import pytest

from mlxvlm.cpu import build_cache, shim_build

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(build_cache.REBUILD_ENV, raising=False)
    return tmp_path / "mlxvlm"


def test_a_failed_build_is_remembered_and_not_compiled_again(empty_cache, monkeypatch):
    attempts = []

    def failing(compiler, target):
        attempts.append(target)
        raise build_cache.BuildError("cc failed: error: boom")

    monkeypatch.setattr(shim_build, "_compile", failing)
    for _ in range(3):
        with pytest.raises(build_cache.BuildError, match="boom"):
            shim_build.build_shim()
    assert len(attempts) == 1
    with pytest.raises(build_cache.BuildError, match="MLXVLM_REBUILD=1"):
        shim_build.build_shim()

    monkeypatch.setenv(build_cache.REBUILD_ENV, "1")
    with pytest.raises(build_cache.BuildError, match="boom"):
        shim_build.build_shim()
    assert len(attempts) == 2


def test_a_build_that_succeeds_after_a_failure_is_used(empty_cache, monkeypatch):
    def failing(compiler, target):
        raise build_cache.BuildError("out of disk")

    def succeeding(compiler, target):
        target.write_bytes(b"built")

    monkeypatch.setattr(shim_build, "_compile", failing)
    with pytest.raises(build_cache.BuildError):
        shim_build.build_shim()
    monkeypatch.setenv(build_cache.REBUILD_ENV, "1")
    monkeypatch.setattr(shim_build, "_compile", succeeding)
    target = shim_build.build_shim()
    assert target.read_bytes() == b"built"
    monkeypatch.delenv(build_cache.REBUILD_ENV)
    assert shim_build.build_shim() == target  # the failure is forgotten
    assert not (target.parent / f"{target.name}.failed").exists()


def test_the_build_holds_the_lock(empty_cache, monkeypatch):
    def compile_while_checking_the_lock(compiler, target):
        lock = target.parent / f"{target.name}.lock"
        with open(lock, "w") as other:  # another process would wait here
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        target.write_bytes(b"built")

    monkeypatch.setattr(shim_build, "_compile", compile_while_checking_the_lock)
    assert shim_build.build_shim().read_bytes() == b"built"


def test_the_fingerprint_follows_the_compiler_version(empty_cache, monkeypatch):
    monkeypatch.setattr(shim_build, "compiler_version", lambda compiler: "cc (Debian) 12.2")
    before = shim_build.target_path("cc")
    monkeypatch.setattr(shim_build, "compiler_version", lambda compiler: "cc (Debian) 99.0")
    assert shim_build.target_path("cc") != before
    assert before.name.startswith("libmlxvlm_blas_shim-") and before.suffix == ".so"


def test_no_compiler_is_a_build_error(empty_cache, monkeypatch):
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(shim_build.shutil, "which", lambda name: None)
    with pytest.raises(build_cache.BuildError, match="no C compiler found"):
        shim_build.build_shim()


@needs_compiler
def test_the_compiler_version_is_asked_once_per_binary(empty_cache, monkeypatch):
    """Kept in the cache directory: a later process (here: a cleared in-process cache)
    reads it instead of starting the compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    build_cache.compiler_version.cache_clear()
    first = build_cache.compiler_version(compiler)
    assert not first.startswith("unknown")
    build_cache.compiler_version.cache_clear()
    monkeypatch.setattr(build_cache, "_ask_version", lambda c: pytest.fail("asked again"))
    assert build_cache.compiler_version(compiler) == first
    build_cache.compiler_version.cache_clear()


@needs_compiler
def test_the_real_shim_builds_into_the_cache(empty_cache):
    target = shim_build.build_shim()
    assert target.exists() and target.parent == empty_cache
    assert shim_build.build_shim() == target  # found, not built again
