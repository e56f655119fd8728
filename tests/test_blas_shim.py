"""The BLAS shim (mlxvlm/cpu/blas_shim.c): mlxvlm's one pool of CPU threads, and the
products OpenBLAS's sgemm gives.

One-row and one-column float32 products go to sgemv, larger ones are split over the
pool with OpenBLAS single-threaded: every layout MLX can hand to cblas_sgemm (transposed
or not, strided rows, alpha/beta of addmm) must equal numpy's result either way; small
products must still reach sgemm whole; the opt-outs must leave it unused. The CPU
kernels run on the same pool (or on their own without the shim) and stay right when its
threads sleep between every job, when two streams use it at once and in a forked child.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

from mlxvlm.cpu import blas, policy

HAS_COMPILER = any(shutil.which(c) for c in (os.environ.get("CC", "cc"), "cc", "gcc"))
needs_shim = pytest.mark.skipif(
    blas.gemv_forward is None,
    reason=f"shim not loaded here: {blas.gemv_forward_status}",
)


def forwarded() -> int:
    return blas.gemv_forward.mlxvlm_gemv_forwarded()


def rng_array(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def in_two_threads(work):
    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def check(got: mx.array, want: np.ndarray):
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(sys.platform != "linux", reason="the OpenBLAS set-up is for Linux")
def test_shim_is_loaded_where_a_compiler_and_openblas_exist():
    """.ci/run installs both; elsewhere the status must say why the shim is not used."""
    if HAS_COMPILER and blas.openblas_status.startswith("loaded"):
        assert "sgemv" in blas.gemv_forward_status, blas.gemv_forward_status
        assert blas.gemv_forward is not None
    else:
        assert blas.gemv_forward is None
        assert blas.gemv_forward_status.startswith(("not used", "disabled", "not attempted"))


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
        "import numpy as np, mlxvlm; from mlxvlm.cpu import blas; import mlx.core as mx\n"
        "x = np.ones((1, 64), np.float32); w = np.ones((32, 64), np.float32)\n"
        "err = float(np.abs(np.array(mx.array(x) @ mx.array(w).T) - 64).max())\n"
        "print(blas.gemv_forward is None, '|', blas.gemv_forward_status, '|', err)\n"
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
        "import mlxvlm, mlx.core; from mlxvlm.cpu import blas\n"
        "print(blas.gemv_forward_status)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sgemv" in out.stdout
    assert list((tmp_path / "mlxvlm").glob("libmlxvlm_blas_shim-*.so"))


def split() -> int:
    return blas.gemv_forward.mlxvlm_products_split()


needs_threads = pytest.mark.skipif(
    blas.pool_threads < 2, reason="one CPU here: products are not split"
)


@pytest.mark.parametrize("rows, cols, depth", [
    (300, 97, 200),  # fewer columns than rows: split by rows
    (45, 700, 130),  # more columns: split by columns
    (1024, 768, 64),  # a tower's shape, block-aligned
    (33, 33, 4000),  # two 16-row blocks and a remainder
])
@pytest.mark.parametrize("layout", ["plain", "transposed_a", "transposed_b", "both", "strided"])
@needs_shim
@needs_threads
def test_split_products_match_numpy(rows, cols, depth, layout):
    a, b = rng_array(rows, depth, seed=20), rng_array(depth, cols, seed=21)
    if layout == "plain":
        x, y = mx.array(a), mx.array(b)
    elif layout == "transposed_a":  # A stored depth x rows
        x, y = mx.array(a.T.copy()).T, mx.array(b)
    elif layout == "transposed_b":  # B stored cols x depth: nn.Linear's x @ W.T
        x, y = mx.array(a), mx.array(b.T.copy()).T
    elif layout == "both":
        x, y = mx.array(a.T.copy()).T, mx.array(b.T.copy()).T
    else:  # slices of wider matrices: leading dimensions above the operands' widths
        wide_a = np.concatenate([a, rng_array(rows, 7, seed=22)], axis=1)
        wide_b = np.concatenate([b, rng_array(depth, 9, seed=23)], axis=1)
        x, y = mx.array(wide_a)[:, :depth], mx.array(wide_b)[:, :cols]
    before = split()
    got = x @ y
    mx.eval(got)
    np.testing.assert_allclose(np.array(got), a @ b, rtol=1e-4, atol=1e-3)
    assert split() > before


@needs_shim
@needs_threads
def test_split_addmm_and_batches():
    a, b, c = rng_array(3, 200, 150, seed=24), rng_array(150, 180, seed=25), rng_array(200, 180, seed=26)
    before = split()
    got = mx.addmm(mx.array(c), mx.array(a[0]), mx.array(b), alpha=1.5, beta=0.25)
    np.testing.assert_allclose(np.array(got), 0.25 * c + 1.5 * (a[0] @ b), rtol=1e-4, atol=1e-3)
    batched = mx.array(a) @ mx.array(b)
    np.testing.assert_allclose(np.array(batched), a @ b, rtol=1e-4, atol=1e-3)
    assert split() >= before + 2


@needs_shim
@needs_threads
def test_large_one_row_products_are_split_over_the_threads():
    W, x = rng_array(3000, 700, seed=27), rng_array(1, 700, seed=28)
    before_split, before_forwarded = split(), forwarded()
    check(mx.array(x) @ mx.array(W).T, x @ W.T)  # sgemv on W's rows
    check(mx.array(x) @ mx.array(W.T.copy()), x @ W.T)  # sgemv on W.T's columns
    check(mx.array(W) @ mx.array(x).T, W @ x.T)  # one column
    assert forwarded() == before_forwarded + 3
    assert split() == before_split + 3


@needs_shim
def test_small_products_stay_whole():
    a, b = rng_array(20, 30, seed=29), rng_array(30, 40, seed=30)
    before = split()
    check(mx.array(a) @ mx.array(b), a @ b)
    check(mx.array(a[:1]) @ mx.array(b), a[:1] @ b)  # a small sgemv
    assert split() == before


@needs_shim
@needs_threads
def test_openblas_runs_single_threaded_inside_the_split():
    import ctypes
    import ctypes.util

    openblas = ctypes.CDLL(ctypes.util.find_library("openblas"))
    assert openblas.openblas_get_num_threads() == 1
    assert f"split over mlxvlm's {blas.pool_threads} threads" in blas.gemv_forward_status


@needs_shim
@needs_threads
def test_concurrent_streams_get_right_products():
    """Two threads, each with its own MLX stream, multiply at once: the one that finds
    the threads busy computes its product whole on its own thread."""
    a, b = rng_array(400, 300, seed=31), rng_array(300, 500, seed=32)
    want = a @ b
    errors = []

    def work():
        stream = mx.new_stream(mx.cpu)
        for _ in range(20):
            with mx.stream(stream):
                got = np.array(mx.array(a) @ mx.array(b))
            errors.append(float(np.abs(got - want).max()))

    in_two_threads(work)
    assert len(errors) == 40 and max(errors) < 1e-2


THREADS_PROBE = (
    "import ctypes, ctypes.util, numpy as np, mlxvlm; from mlxvlm.cpu import blas\n"
    "import mlx.core as mx\n"
    "a = np.random.default_rng(0).normal(size=(300, 200)).astype(np.float32)\n"
    "b = np.random.default_rng(1).normal(size=(200, 250)).astype(np.float32)\n"
    "err = float(np.abs(np.array(mx.array(a) @ mx.array(b)) - a @ b).max())\n"
    "openblas = ctypes.CDLL(ctypes.util.find_library('openblas'))\n"
    "print(blas.gemv_forward_status, '|', blas.gemv_forward.mlxvlm_products_split(),"
    " '|', openblas.openblas_get_num_threads(), '|', err)\n"
)


@needs_shim
@pytest.mark.parametrize("threads", ["1", "3"])
def test_thread_count_follows_mlxvlm_cpu_threads(threads):
    """MLXVLM_CPU_THREADS=1 computes every product on one thread; 3 splits them in three.
    OpenBLAS runs single-threaded inside either."""
    env = {**os.environ, "MLXVLM_CPU_THREADS": threads}
    out = subprocess.run([sys.executable, "-c", THREADS_PROBE], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    status, splits, blas_threads, err = (p.strip() for p in out.stdout.split("|"))
    assert float(err) < 1e-2
    if threads == "1":
        assert "products on one thread" in status and splits == "0"
    else:
        assert "split over mlxvlm's 3 threads" in status and int(splits) >= 1
    assert blas_threads == "1"


# ------------------------------------------------------------ the kernels on the pool


def pool_jobs() -> int:
    return blas.gemv_forward.mlxvlm_pool_jobs()


def attention_reference(q, k, v, scale):
    scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64)) * scale
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", scores / scores.sum(-1, keepdims=True), v)


def attention_inputs(seed=40):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(1, 4, 96, 64)).astype(np.float32) for _ in range(3)]


@needs_shim
@needs_threads
def test_kernels_run_on_the_shims_pool():
    """One set of threads: the kernels' jobs are the shim's pool's jobs."""
    from mlxvlm.cpu import kernels

    module = kernels.load()
    if module is None:
        pytest.skip(f"the CPU kernels are {kernels.status}")
    assert module.shares_blas_pool()
    assert module.threads() == blas.pool_threads
    assert "shared with the float32 products" in kernels.describe()
    q, k, v = attention_inputs()
    before = pool_jobs()
    got = kernels.attention(mx.array(q), mx.array(k), mx.array(v), scale=0.125)
    mx.eval(got)
    assert pool_jobs() > before
    np.testing.assert_allclose(np.array(got), attention_reference(q, k, v, 0.125),
                               rtol=1e-4, atol=1e-5)


POOL_PROBE = """
import numpy as np, mlxvlm
from mlxvlm.cpu import blas, kernels
import mlx.core as mx
module = kernels.load()
rng = np.random.default_rng(0)
q, k, v = (rng.normal(size=(1, 4, 96, 64)).astype(np.float32) for _ in range(3))
s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) * 0.125
s = np.exp(s - s.max(-1, keepdims=True)); want = np.einsum("bhqk,bhkd->bhqd", s / s.sum(-1, keepdims=True), v)
a = rng.normal(size=(300, 200)).astype(np.float32); b = rng.normal(size=(200, 250)).astype(np.float32)
x = rng.normal(size=(1, 700)).astype(np.float32); w = rng.normal(size=(3000, 700)).astype(np.float32)
def check_all(rounds):
    err = 0.0
    for _ in range(rounds):  # kernels, products and one-row products, back to back
        got = kernels.attention(mx.array(q), mx.array(k), mx.array(v), scale=0.125)
        err = max(err, float(np.abs(np.array(got) - want).max()))
        err = max(err, float(np.abs(np.array(mx.array(a) @ mx.array(b)) - a @ b).max()) / 100)
        err = max(err, float(np.abs(np.array(mx.array(x) @ mx.array(w).T) - x @ w.T).max()) / 100)
    return err
"""


def run_probe(code: str, **env_vars) -> str:
    env = {**os.environ, **env_vars}
    out = subprocess.run([sys.executable, "-c", POOL_PROBE + code], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@needs_shim
def test_kernels_keep_their_own_pool_without_the_shim():
    out = run_probe(
        "print(blas.gemv_forward is None, module.shares_blas_pool(), module.threads(),"
        " check_all(3))", MLXVLM_NO_GEMV_FORWARD="1", MLXVLM_CPU_THREADS="3")
    no_shim, shared, threads, err = out.split()
    assert (no_shim, shared, threads) == ("True", "False", "3")
    assert float(err) < 1e-4


@needs_shim
@pytest.mark.parametrize("threads", ["2", "3"])
def test_threads_that_sleep_after_every_job(threads):
    """MLXVLM_CPU_SPIN_US=0: a thread that finds no job sleeps at once, so every job it
    takes wakes it; 3 threads on this machine's CPUs also makes them wait for a core.
    Whatever the scheduling, none takes a job by spinning (a busy core once made them
    yield a few times before looking at the clock, and so spin)."""
    out = run_probe("err = check_all(100)\n"
                    "shim = blas.gemv_forward\n"
                    "print(module.threads(), shim.mlxvlm_pool_jobs(), shim.mlxvlm_pool_sleeps(),"
                    " shim.mlxvlm_pool_spun(), err)",
                    MLXVLM_CPU_SPIN_US="0", MLXVLM_CPU_THREADS=threads,
                    # numpy's own OpenBLAS (the references) would otherwise keep threads
                    # of its own spinning on the shared cores after each of its products.
                    OPENBLAS_NUM_THREADS="1")
    count, jobs, sleeps, spun, err = out.split()
    assert count == threads and int(jobs) >= 300  # each round: attention, product, one-row
    assert spun == "0"
    assert int(sleeps) >= 1  # a thread started for the first job waits for a later one
    assert float(err) < 1e-4


SPIN_PROBE = """
import mlxvlm
from mlxvlm.cpu import blas
import mlx.core as mx
a, b = mx.random.normal((300, 200)), mx.random.normal((200, 250))
mx.eval(a, b, a @ b)
shim = blas.gemv_forward
jobs, sleeps, spun = shim.mlxvlm_pool_jobs(), shim.mlxvlm_pool_sleeps(), shim.mlxvlm_pool_spun()
for _ in range(200):  # split products back to back: microseconds between jobs
    mx.eval(a @ b)
print(shim.mlxvlm_pool_jobs() - jobs, shim.mlxvlm_pool_sleeps() - sleeps,
      shim.mlxvlm_pool_spun() - spun)
"""


@needs_shim
@needs_threads
@pytest.mark.parametrize("spin_us", ["0", "3600000000"])
def test_spin_setting_decides_when_idle_threads_sleep(spin_us):
    """Between back-to-back jobs an idle thread sleeps at once with MLXVLM_CPU_SPIN_US=0
    (it never takes a job by spinning), and never within an hour's spin (it takes every
    job it waits for by spinning). Both hold however busy the machine is."""
    out = subprocess.run([sys.executable, "-c", SPIN_PROBE], capture_output=True, text=True,
                         env={**os.environ, "MLXVLM_CPU_SPIN_US": spin_us}, timeout=120)
    assert out.returncode == 0, out.stderr
    jobs, sleeps, spun = map(int, out.stdout.split())
    assert jobs == 200
    if spin_us == "0":
        assert spun == 0 and sleeps >= 1
    else:
        assert sleeps == 0 and spun >= 1


@pytest.mark.parametrize("value, expected", [("", 1000), ("0", 0), ("250", 250),
                                             ("-5", 1000), ("fast", 1000),
                                             ("9" * 30, 1 << 62)])
def test_spin_setting_is_read_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("MLXVLM_CPU_SPIN_US", value)
    assert policy.spin_microseconds() == expected


def test_thread_count_setting_is_read_from_the_environment(monkeypatch):
    allowed = len(os.sched_getaffinity(0))
    for value, expected in [("3", 3), ("", allowed), ("0", allowed), ("many", allowed)]:
        monkeypatch.setenv("MLXVLM_CPU_THREADS", value)
        assert policy.cpu_threads() == expected


FORK_PROBE = """
import ctypes, os, signal
import numpy as np
import mlxvlm
import mlx.core  # mlxvlm's BLAS set-up runs as MLX loads
from mlxvlm.cpu import blas
shim = blas.gemv_forward
shim.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                             ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
rng = np.random.default_rng(0)
a = rng.normal(size=(300, 200)).astype(np.float32); b = rng.normal(size=(200, 250)).astype(np.float32)

def product_error():  # the process's cblas_sgemm, as libmlx calls it: split over the pool
    c = np.zeros((300, 250), np.float32)
    shim.cblas_sgemm(101, 111, 111, 300, 250, 200, 1.0, a.ctypes.data, 200, b.ctypes.data,
                     250, 0.0, c.ctypes.data, 250)
    return float(np.abs(c - a @ b).max())

def pool_threads():  # the pool's threads in this process, by the name the shim gives them
    tasks = "/proc/self/task"
    return sum(open(f"{tasks}/{t}/comm").read().strip() == "mlxvlm-pool" for t in os.listdir(tasks))

parent = product_error(); jobs = shim.mlxvlm_pool_jobs()
assert pool_threads() == blas.pool_threads - 1
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a deadlock fails the test instead of hanging it
    before = pool_threads()  # fork() copies only the calling thread
    ok = product_error() < 1e-3 and shim.mlxvlm_pool_jobs() > jobs
    os._exit(0 if ok and before == 0 and pool_threads() == blas.pool_threads - 1 else 1)
_, status = os.waitpid(pid, 0)
print(parent < 1e-3, jobs > 0, os.waitstatus_to_exitcode(status))
"""


@needs_shim
@needs_threads
def test_a_forked_child_starts_its_own_threads():
    """After the parent's pool ran, a fork()ed child (whose copy of the pool has no
    threads) splits its products over threads of its own. (MLX itself cannot compute in
    a child forked after it ran, so the probe calls the shim's cblas_sgemm directly.)"""
    out = subprocess.run([sys.executable, "-c", FORK_PROBE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "0"]


@needs_shim
@needs_threads
def test_two_streams_share_the_pool_with_the_kernels():
    """Kernels and products from two threads at once: the caller that finds the pool busy
    runs its job alone, and every result is right."""
    from mlxvlm.cpu import kernels

    if kernels.load() is None:
        pytest.skip(f"the CPU kernels are {kernels.status}")
    q, k, v = attention_inputs(seed=41)
    want = attention_reference(q, k, v, 0.125)
    a, b = rng_array(300, 200, seed=42), rng_array(200, 250, seed=43)
    errors = []

    def work():
        stream = mx.new_stream(mx.cpu)
        for _ in range(15):
            with mx.stream(stream):
                got = kernels.attention(mx.array(q), mx.array(k), mx.array(v), scale=0.125)
                product = mx.array(a) @ mx.array(b)
                mx.eval(got, product)
            errors.append(max(float(np.abs(np.array(got) - want).max()),
                              float(np.abs(np.array(product) - a @ b).max()) / 100))

    in_two_threads(work)
    assert len(errors) == 30 and max(errors) < 1e-4
