"""Vision and audio towers evaluated a layer at a time on MLX's CPU backend.

MLX's CPU backend allocates each operation's output when it schedules the operation, on
the calling thread, while one worker thread computes: left alone, scheduling runs far
ahead of the computation (a 12-layer SigLIP tower: ~100 MB of activations allocated at
once, twice what one layer needs). Inside ``bounded_run_ahead()`` the towers evaluate
each layer's output as they build the next (``layer_done``), so what is allocated ahead
is one layer's operations (the ViT encoder's layers: one half's, as they call it after
their attention too). Building a layer's graph takes ~1 ms against 50-500 ms of
computing it.

This used to be MLX's memory limit set just above the memory in use. Over the limit,
MLX's scheduler waits for running work in a loop that spins while a single operation
runs, which took one of two cores from the matrix products: Qwen2-VL-2B's tower
15-16 s unbounded, 21-23 s bounded that way, on a 2-core x86-64 machine.

Elsewhere (Metal, CUDA) and outside the context nothing changes: ``layer_done`` does
nothing, so training and other callers keep MLX's lazy evaluation.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import mlx.core as mx

_state = threading.local()  # per thread: the server generates on its own threads


def active() -> bool:
    """Whether towers evaluate a layer at a time here (inside ``bounded_run_ahead``)."""
    return getattr(_state, "inside", False)


@contextlib.contextmanager
def bounded_run_ahead() -> Iterator[None]:
    """Towers built inside evaluate a layer at a time (on the CPU); nested uses keep the
    outermost (the generate loop bounds the whole ``embed``, a cached tower its own
    encoding inside it)."""
    if mx.default_device() != mx.cpu or active():
        yield
        return
    _state.inside = True
    try:
        yield
    finally:
        _state.inside = False


def layer_done(*outputs: mx.array) -> None:
    """A tower layer's ``outputs`` are built: inside ``bounded_run_ahead``, evaluate them
    now, before the next layer's operations are scheduled."""
    if active():
        mx.eval(*outputs)
