"""The BLAS shim's build (mlxvlm/cpu/shim_build.py): keyed by its source and the
compiler's own version (its failure memory and lock: test_build_cache.py)."""

from __future__ import annotations

import shutil

import pytest

from mlxvlm.cpu import build_cache, shim_build

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


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
