"""What the compiled-on-first-use artefacts share (mlxvlm/cpu/build_cache.py's
``build_once``), checked through each artefact's own build: the CPU kernels
(cpu/kernels/build.py) and the BLAS shim (cpu/shim_build.py). Each must be cheap to
fail (a failure remembered, not compiled again), recover once a rebuild succeeds, and
build one at a time (a lock other processes wait on)."""

from __future__ import annotations

import fcntl
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from mlxvlm.cpu import build_cache, shim_build
from mlxvlm.cpu.kernels import build as kernel_build


@dataclass(frozen=True)
class Artefact:
    module: object
    compile_name: str  # the function that runs the compiler, replaced in these tests
    build: Callable[[], Path]


ARTEFACTS = {
    "kernels": Artefact(kernel_build, "_compile_and_link", kernel_build.build),
    "blas-shim": Artefact(shim_build, "_compile", shim_build.build_shim),
}


@pytest.fixture(params=sorted(ARTEFACTS))
def artefact(request) -> Artefact:
    return ARTEFACTS[request.param]


def _write_product(*args) -> None:
    target = args[-1]  # both compile functions take the product's path last
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"built")


def test_a_failed_build_is_remembered_and_not_compiled_again(artefact, empty_cache,
                                                             monkeypatch):
    attempts = []

    def failing(*args):
        attempts.append(args[-1])
        raise build_cache.BuildError("compiling failed: error: boom")

    monkeypatch.setattr(artefact.module, artefact.compile_name, failing)
    for _ in range(3):
        with pytest.raises(build_cache.BuildError, match="boom"):
            artefact.build()
    assert len(attempts) == 1
    with pytest.raises(build_cache.BuildError, match="MLXVLM_REBUILD=1"):
        artefact.build()

    monkeypatch.setenv(build_cache.REBUILD_ENV, "1")
    with pytest.raises(build_cache.BuildError, match="boom"):
        artefact.build()
    assert len(attempts) == 2


def test_a_build_that_succeeds_after_a_failure_is_used(artefact, empty_cache, monkeypatch):
    def failing(*args):
        raise build_cache.BuildError("out of disk")

    monkeypatch.setattr(artefact.module, artefact.compile_name, failing)
    with pytest.raises(build_cache.BuildError):
        artefact.build()
    monkeypatch.setenv(build_cache.REBUILD_ENV, "1")
    monkeypatch.setattr(artefact.module, artefact.compile_name, _write_product)
    target = artefact.build()
    assert target.read_bytes() == b"built"
    monkeypatch.delenv(build_cache.REBUILD_ENV)
    assert artefact.build() == target  # found, not built again
    assert not list(empty_cache.rglob("*.failed"))  # the failure is forgotten


def test_the_build_holds_a_lock_that_other_processes_wait_on(artefact, empty_cache,
                                                             monkeypatch):
    held = []

    def compile_while_checking_the_lock(*args):
        locks = list(empty_cache.rglob("*.lock"))
        assert locks, "no lock file while building"
        for lock_file in locks:
            with open(lock_file, "w") as other:  # another open file: as another process
                with pytest.raises(BlockingIOError):
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.extend(locks)
        _write_product(*args)

    monkeypatch.setattr(artefact.module, artefact.compile_name,
                        compile_while_checking_the_lock)
    artefact.build()
    assert held
    for lock_file in held:
        with open(lock_file, "w") as other:  # released once the build is done
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
