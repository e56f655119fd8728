"""The CPU kernels' build: keyed by all it depends on, and checked by a first call before
any model uses it (its failure memory and lock: test_build_cache.py)."""

from __future__ import annotations

import types

import mlx.core as mx
import pytest

from mlxvlm.cpu import kernels
from mlxvlm.cpu.kernels import build


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

    def set_isa_cap(self, cap): pass

    def set_half_gemm(self, value): pass

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
