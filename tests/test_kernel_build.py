"""The CPU kernels' build: cheap to fail, one at a time, keyed by all it depends on, and
checked by a first call before any model uses it."""

from __future__ import annotations

import fcntl
import types

import mlx.core as mx
import pytest

from mlxvlm.cpu import build_cache, kernels
from mlxvlm.cpu.kernels import build


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(build_cache.REBUILD_ENV, raising=False)
    return tmp_path / "mlxvlm"


def test_a_failed_build_is_remembered_and_not_compiled_again(empty_cache, monkeypatch):
    attempts = []

    def failing(tools, target_dir, target):
        attempts.append(target_dir)
        raise build_cache.BuildError("compiling attention.cpp failed: error: boom")

    monkeypatch.setattr(build, "_compile_and_link", failing)
    for _ in range(3):
        with pytest.raises(build_cache.BuildError, match="boom"):
            build.build()
    assert len(attempts) == 1
    with pytest.raises(build_cache.BuildError, match="MLXVLM_REBUILD=1"):
        build.build()

    monkeypatch.setenv(build_cache.REBUILD_ENV, "1")
    with pytest.raises(build_cache.BuildError, match="boom"):
        build.build()
    assert len(attempts) == 2


def test_a_build_that_succeeds_after_a_failure_is_used(empty_cache, monkeypatch):
    def failing(tools, target_dir, target):
        raise build_cache.BuildError("out of disk")

    def succeeding(tools, target_dir, target):
        target_dir.mkdir(parents=True)
        target.write_bytes(b"built")

    monkeypatch.setattr(build, "_compile_and_link", failing)
    with pytest.raises(build_cache.BuildError):
        build.build()
    monkeypatch.setenv(build_cache.REBUILD_ENV, "1")
    monkeypatch.setattr(build, "_compile_and_link", succeeding)
    target = build.build()
    assert target.read_bytes() == b"built"
    monkeypatch.delenv(build_cache.REBUILD_ENV)
    assert build.build() == target
    assert not list(empty_cache.glob("*.failed"))


def test_the_build_holds_a_lock_that_other_processes_wait_on(empty_cache, monkeypatch):
    seen = []

    def compile_while_checking_the_lock(tools, target_dir, target):
        lock_file = target_dir.parent / f"{target_dir.name}.lock"
        with open(lock_file, "w") as other:  # another open file: as another process
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        seen.append(lock_file)
        target_dir.mkdir(parents=True)
        target.write_bytes(b"built")

    monkeypatch.setattr(build, "_compile_and_link", compile_while_checking_the_lock)
    build.build()
    assert seen
    with open(seen[0], "w") as other:  # released once the build is done
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_fingerprint_covers_the_compiler_version_and_the_mlx_install(monkeypatch):
    tools = build._toolchain()
    base = build._fingerprint(tools)
    assert build._fingerprint(dict(tools, mlx_lib="/other/env/mlx/lib")) != base
    monkeypatch.setattr(build, "compiler_version", lambda compiler: "g++ (Debian) 99.0")
    assert build._fingerprint(tools) != base


class _BrokenBinding:
    """An extension that imports but computes nonsense (as an ABI mismatch might)."""

    Activation = types.SimpleNamespace(silu=0)

    def set_sgemm(self, address): pass

    def set_threads(self, n): pass

    def activation(self, x, kind, up):
        return mx.zeros_like(x)


def test_kernels_that_fail_their_first_call_are_not_used(monkeypatch):
    monkeypatch.setattr(kernels, "status", kernels.status)  # restored after the test
    monkeypatch.setattr(kernels, "_import", lambda path: _BrokenBinding())
    assert kernels._build_and_import() is None
    assert "failed their first call" in kernels.status


def test_the_real_kernels_pass_their_first_call():
    module = kernels.load()
    assert module is not None, kernels.status
    kernels._smoke_call(module)
