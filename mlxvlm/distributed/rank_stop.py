"""How a rank of a sharded command ends when it cannot go on: a peer rank or the launcher
gone, or a signal that finds it waiting inside a collective -- at once, saying why.

MLX's collectives wait in C++: the ring backend can wait forever on a peer that was
killed, deaf to Python's signal handlers (they run on the main thread, between bytecodes),
and the process's exit handlers would wait on that collective too (MLX's destructors join
its thread). So the process ends from another thread, by ``os._exit`` (``exit_now``):

- ``PeerWatch`` (``peer_watch``) sees a peer's ring connection close, or the launcher go;
- on rank 0 of the generate command, SIGTERM and SIGINT are also seen from a thread (the
  interpreter's wakeup descriptor): SIGTERM ends the rank at once (as its default does,
  but saying so, and naming the rank that is gone when one is: mlx.launch sends it to
  the other ranks when one exits); SIGINT raises ``KeyboardInterrupt`` as usual, and ends
  the rank from the thread if its main thread is still inside a step ``SIGINT_GRACE``
  seconds later, or at a second SIGINT.

The server's rank 0 stops through uvicorn instead (``server.sharded_stop``), with
``exit_now`` and ``PeerWatch`` from here.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

from mlxvlm.distributed.peer_watch import PeerWatch

# How long a Ctrl-C'd rank 0 waits for its step to end on its own (KeyboardInterrupt and
# the release of the other ranks) before it ends the process.
SIGINT_GRACE = 3.0


def exit_now(code: int) -> None:
    """End the process at once (no exit handlers: they could wait on a stuck collective),
    after flushing what it logged and printed."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class RankStop:
    """``with RankStop(rank, say):`` the run of a rank that ends, status 1, when a peer or
    the launcher is gone: ``say(reason)`` is called first (e.g. ``rank 1 is gone (its
    connection to rank 0 closed)``). Leaving the block ends the watch (the ranks leave
    after the run's last collective, which must not read as a loss); an error raised in the
    block while a peer is seen gone (a ``RankLostError``) ends the process the same way,
    so that the loss is told once, in the same words, whichever saw it first. With
    ``signals=True`` (the main thread's, rank 0 of a command), SIGTERM and SIGINT are
    watched too (see the module's docstring)."""

    def __init__(self, rank: int, say: Callable[[str], None], signals: bool = False):
        self.rank = rank
        self.say = say
        self._lock = threading.Lock()
        self._finished = False
        self._interrupted = False  # a SIGINT came: a loss it caused ends as interrupted
        self._watch = PeerWatch(rank, self._lost)
        self._signals = signals
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1

    @property
    def watched(self) -> str:
        return self._watch.watched

    def __enter__(self) -> "RankStop":
        self._watch.start()
        if self._signals:
            self._watch_signals()
        return self

    def __exit__(self, kind, exc, traceback) -> None:
        # (an error while a peer or the launcher is gone is the loss's: a failed collective,
        # or a print to the launcher's pipe that went with it)
        reason = self._watch.lost() if isinstance(exc, Exception) else None
        with self._lock:
            self._finished = True
        self._watch.stop()
        self._restore_signals()
        if reason is not None:
            self._end(reason)

    def _lost(self, reason: str) -> None:
        """``PeerWatch``'s call, from its thread."""
        with self._lock:  # (held until the end: the main thread cannot finish meanwhile)
            if not self._finished:
                self._end(reason)

    def _end(self, reason: str, code: int = 1) -> None:
        try:
            self.say(reason)
        except (OSError, ValueError):  # (the launcher gone, its pipes went with it)
            pass
        # (Ctrl-C in a terminal interrupts every rank: the others leaving is its doing)
        exit_now(130 if self._interrupted and code == 1 else code)

    # Signals, seen from a thread: the interpreter writes each one's number to the wakeup
    # descriptor from its C handler, while its Python handler waits for the main thread.
    def _watch_signals(self) -> None:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._wakeup = (reader, writer)
        self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _ignore)}
        if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:  # (its handler must be Python's)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT,
                                                          signal.default_int_handler)
        self._previous_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._read_signals, args=(reader,), name="mlxvlm-signal-watch",
                         daemon=True).start()

    def _restore_signals(self) -> None:
        if self._wakeup is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._wakeup[1].close()  # (the reader sees the end and returns)
        self._wakeup = None

    def _read_signals(self, reader: socket.socket) -> None:
        interrupted: float | None = None
        with reader:
            while True:
                if interrupted is not None:  # (a timeout of 0 would make it non-blocking)
                    reader.settimeout(max(0.01, interrupted + SIGINT_GRACE - time.monotonic()))
                try:
                    received = reader.recv(64)
                except TimeoutError:
                    self._signalled("stopped on SIGINT (its step did not end: a rank does "
                                    "not answer)", 130)
                    return
                except OSError:
                    return
                if not received:
                    return
                for signum in received:
                    if signum == signal.SIGTERM:
                        self._signalled("stopped on SIGTERM", 143)
                        return
                    if signum == signal.SIGINT and interrupted is not None:
                        self._signalled("stopped at once on a second SIGINT", 130)
                        return
                    if signum == signal.SIGINT:
                        interrupted = time.monotonic()
                        self._interrupted = True

    def _signalled(self, stopped: str, code: int) -> None:
        """Ends the rank on a signal, naming the peer gone where one is (mlx.launch sends
        SIGTERM to the other ranks when one exits)."""
        with self._lock:
            if self._finished:
                return
            reason = self._watch.lost()
            if reason is None:
                self._end(stopped, code)
            else:
                self._end(reason)


def watched_run(model, say: Callable[[str], None], signals: bool = False):
    """``RankStop`` for ``model``'s rank when it is sharded (a context that does nothing
    otherwise)."""
    import contextlib

    if model.sharding is None:
        return contextlib.nullcontext()
    return RankStop(model.sharding.rank, say, signals=signals)


def say_error(reason: str) -> None:
    """A command's ``say``: its one-line error."""
    print(f"error: {reason}", file=sys.stderr, flush=True)


def end_mid_answer(error: BaseException) -> None:
    """Rank 0 of a command, stopped inside a run the other ranks are still in (Ctrl-C, a
    failed write): as ``run_cli`` would say it (status 130 on Ctrl-C), then at once."""
    try:
        if isinstance(error, KeyboardInterrupt):
            print("interrupted", file=sys.stderr, flush=True)
        else:
            say_error(str(error))
    except (OSError, ValueError):  # (stderr gone too)
        pass
    exit_now(130 if isinstance(error, KeyboardInterrupt) else 1)


def _ignore(signum, frame) -> None:
    """SIGTERM's Python handler: nothing (the signal thread ends the process)."""
