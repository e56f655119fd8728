"""MLX's per-thread state, released by the thread that made it before the thread ends.

Each thread that runs MLX owns a compile cache (holding the Python functions it compiled,
mlx-lm's samplers among them) and the CPU backend's command encoders. Left to C++'s
``thread_local`` destructors, they are freed after the Python side of the thread has
finished: ``join()`` has already returned, and if the main thread is finalizing the
interpreter by then, dropping a Python reference there aborts the process ("terminate
called without an active exception"). MLX's advice (``mx.clear_streams``' docstring, PR
ml-explore/mlx#3395) is to clear them at the end of every thread; this does it for
threads whose body mlxvlm does not own the end of (pool workers, its own loops) by
tying the call to the thread's ``threading.local`` storage, which Python clears on the
thread itself, with the GIL held, before ``join()`` returns. The main thread's state is
cleared by an ``atexit`` handler, which runs before the interpreter is finalized
(``process_setup`` registers it as MLX first loads).
"""

from __future__ import annotations

import atexit
import sys
import threading

_this_thread = threading.local()


def _clear_streams() -> None:
    mlx = sys.modules.get("mlx.core")  # nothing to clear where MLX never loaded
    if mlx is not None:
        mlx.clear_streams()


class _ClearStreamsOnThreadEnd:
    def __del__(self) -> None:
        _clear_streams()


def clear_streams_when_thread_ends() -> None:
    """Have ``mx.clear_streams()`` run at the end of the calling thread (once however
    often this is called; cheap enough to call at the top of every job). The main
    thread's are cleared at exit instead (``clear_main_thread_streams_at_exit``)."""
    if threading.current_thread() is threading.main_thread():
        return
    if getattr(_this_thread, "release", None) is None:
        _this_thread.release = _ClearStreamsOnThreadEnd()


def clear_main_thread_streams_at_exit() -> None:
    atexit.register(_clear_streams)
