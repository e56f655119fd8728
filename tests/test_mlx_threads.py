"""MLX's per-thread state is released by each thread mlxvlm runs MLX on, before the
thread is joined (mlxvlm/mlx_threads.py): left to C++'s thread-exit destructors, it is
freed after ``join()`` returns and can abort a process that is exiting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import types

from mlxvlm.mlx_threads import clear_streams_when_thread_ends


def fake_mlx(monkeypatch) -> list[int]:
    """The threads (by ident: the thread has left ``threading``'s table by then) that
    cleared their streams."""
    cleared: list[int] = []
    fake = types.SimpleNamespace(clear_streams=lambda: cleared.append(threading.get_ident()))
    monkeypatch.setitem(sys.modules, "mlx.core", fake)
    return cleared


def test_a_thread_clears_its_streams_once_before_it_is_joined(monkeypatch):
    cleared = fake_mlx(monkeypatch)

    def job():
        clear_streams_when_thread_ends()
        clear_streams_when_thread_ends()  # every job of a pool worker asks again

    worker = threading.Thread(target=job, name="mlx-worker")
    worker.start()
    worker.join()
    assert cleared.count(worker.ident) == 1


def test_pool_workers_and_the_engine_thread_clear_theirs(monkeypatch):
    from mlxvlm.batching.engine_thread import EngineThread
    from mlxvlm.preparation import PreparationPools

    cleared = fake_mlx(monkeypatch)
    pools = PreparationPools(1, 1, name="probe")
    assert pools.submit(lambda: 1, media=True).future.result(timeout=30) == 1
    workers = [t for t in threading.enumerate() if t.name.startswith("probe-media")]
    pools.close()
    for worker in workers:
        worker.join(timeout=30)
    assert workers and all(cleared.count(worker.ident) == 1 for worker in workers)

    class Engine(EngineThread):
        thread_name = "probe-engine"

        def __init__(self):
            self._init_thread()

        def _run(self):
            with self._cond:
                self._wait_for(lambda: False)

    cleared.clear()  # a new thread may reuse an ended one's ident
    engine = Engine()
    engine.start()
    engine._stop_thread(timeout=30)
    assert cleared.count(engine._thread.ident) == 1


def test_the_main_thread_is_left_to_exit(monkeypatch):
    cleared = fake_mlx(monkeypatch)
    clear_streams_when_thread_ends()  # the main thread's are cleared by atexit instead
    assert cleared == []


# Eight threads that each run a compiled function and end, then the process exits: with
# nothing cleared, about one such run in ten aborted here ("terminate called without an active
# exception"); the same runs through mlxvlm's helper, none.
THREADS_THEN_EXIT = textwrap.dedent(
    """
    import threading
    import mlxvlm  # its process set-up registers the main thread's clearing
    import mlx.core as mx
    from mlxvlm.mlx_threads import clear_streams_when_thread_ends

    @mx.compile
    def step(x):
        return mx.exp(x) * 2 + 1

    def work():
        clear_streams_when_thread_ends()
        for _ in range(3):
            mx.eval(step(mx.ones((64,))))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mx.eval(step(mx.ones((64,))))  # the main thread's, cleared at exit
    """
)


def test_processes_whose_threads_ran_compiled_mlx_exit_cleanly():
    for run in range(40):
        done = subprocess.run([sys.executable, "-c", THREADS_THEN_EXIT],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"run {run}: {done.returncode} {done.stderr[-2000:]}"
