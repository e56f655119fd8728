"""The sgemm shim (mlxvlm/_sgemm_gemv.c) gives libmlx the products OpenBLAS's sgemm gives.

One-row and one-column float32 products go to sgemv: every layout MLX can hand to
cblas_sgemm (transposed or not, strided rows, alpha/beta of addmm) must equal numpy's
result; everything else must still reach sgemm; the opt-out must leave it unused.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlxvlm import _backend

HAS_COMPILER = any(shutil.which(c) for c in (os.environ.get("CC", "cc"), "cc", "gcc"))
needs_shim = pytest.mark.skipif(
    _backend.gemv_forward is None,
    reason=f"shim not loaded here: {_backend.gemv_forward_status}",
)


def forwarded() -> int:
    return _backend.gemv_forward.mlxvlm_gemv_forwarded()


def rng_array(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def check(got: mx.array, want: np.ndarray):
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(sys.platform != "linux", reason="the OpenBLAS set-up is for Linux")
def test_shim_is_loaded_where_a_compiler_and_openblas_exist():
    """.ci/run installs both; elsewhere the status must say why the shim is not used."""
    if HAS_COMPILER and _backend.openblas_status.startswith("loaded"):
        assert "sgemv" in _backend.gemv_forward_status, _backend.gemv_forward_status
        assert _backend.gemv_forward is not None
    else:
        assert _backend.gemv_forward is None
        assert _backend.gemv_forward_status.startswith(("not used", "disabled", "not attempted"))


@pytest.mark.parametrize(
    "case",
    [
        "row_times_transposed",  # x (1 x K) @ W.T: the decode product of nn.Linear
        "row_times_matrix",  # x (1 x K) @ W (K x N)
        "matrix_times_column",  # W (N x K) @ x (K x 1)
        "transposed_times_column",  # W.T (K x N)^T-stored @ x
        "matrix_times_vector",  # 2-D @ 1-D
        "strided_rows",  # a slice of a wider matrix: leading dimension > K
        "transposed_row",  # a (K x 1) column transposed into the row operand
        "batched_rows",  # a batch of one-row products (MLX may fold it into one sgemm)
    ],
)
@needs_shim
def test_single_row_and_column_products_match_numpy(case):
    W = rng_array(300, 200, seed=1)
    x = rng_array(1, 200, seed=2)
    before = forwarded()
    if case == "row_times_transposed":
        got, want = mx.array(x) @ mx.array(W).T, x @ W.T
    elif case == "row_times_matrix":
        got, want = mx.array(x) @ mx.array(W.T.copy()), x @ W.T
    elif case == "matrix_times_column":
        got, want = mx.array(W) @ mx.array(x).T, W @ x.T
    elif case == "transposed_times_column":
        v = rng_array(300, 1, seed=3)
        got, want = mx.array(W).T @ mx.array(v), W.T @ v
    elif case == "matrix_times_vector":
        got, want = mx.array(W) @ mx.array(x[0]), W @ x[0]
    elif case == "strided_rows":
        wide = rng_array(300, 260, seed=4)
        got, want = mx.array(x) @ mx.array(wide)[:, :200].T, x @ wide[:, :200].T
    elif case == "transposed_row":
        column = rng_array(200, 1, seed=5)
        got, want = mx.array(column).T @ mx.array(W).T, column.T @ W.T
    else:
        xs = rng_array(4, 1, 200, seed=6)
        got, want = mx.array(xs) @ mx.array(W).T, xs @ W.T
    check(got, want)
    if case != "batched_rows":
        assert forwarded() > before


@needs_shim
def test_addmm_alpha_and_beta():
    W, x, c = rng_array(300, 200, seed=7), rng_array(1, 200, seed=8), rng_array(1, 300, seed=9)
    got = mx.addmm(mx.array(c), mx.array(x), mx.array(W).T, alpha=2.0, beta=0.5)
    check(got, 0.5 * c + 2.0 * (x @ W.T))


@needs_shim
def test_other_products_still_use_sgemm():
    a, b = rng_array(7, 50, seed=10), rng_array(50, 9, seed=11)
    before = forwarded()
    check(mx.array(a) @ mx.array(b), a @ b)
    one = rng_array(1, 50, seed=12)
    check(mx.array(one) @ mx.array(b[:, :1]), one @ b[:, :1])  # 1 x 1: a dot product
    assert forwarded() == before


@needs_shim
def test_opt_out_leaves_the_shim_unused():
    probe = (
        "import numpy as np, mlxvlm; from mlxvlm import _backend; import mlx.core as mx\n"
        "x = np.ones((1, 64), np.float32); w = np.ones((32, 64), np.float32)\n"
        "err = float(np.abs(np.array(mx.array(x) @ mx.array(w).T) - 64).max())\n"
        "print(_backend.gemv_forward is None, '|', _backend.gemv_forward_status, '|', err)\n"
    )
    env = {**os.environ, "MLXVLM_NO_GEMV_FORWARD": "1"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    unused, status, err = (part.strip() for part in out.stdout.split("|"))
    assert unused == "True" and status == "disabled by MLXVLM_NO_GEMV_FORWARD"
    assert float(err) == 0.0


@needs_shim
def test_shim_builds_into_the_cache_directory(tmp_path):
    """A fresh cache directory: the shim is compiled there and loads."""
    probe = (
        "import mlxvlm; from mlxvlm import _backend\n"
        "print(_backend.gemv_forward_status)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sgemv" in out.stdout
    assert list((tmp_path / "mlxvlm").glob("libmlxvlm_sgemm_gemv-*.so"))
