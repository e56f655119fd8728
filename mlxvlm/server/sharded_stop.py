"""How rank 0 of a sharded server stops: on SIGTERM or SIGINT, and on its own when a peer
rank is gone -- promptly, saying why, even when its engine's thread waits inside a
collective that will never complete.

MLX's collectives wait in C++ without looking at Python's signals, and the ring backend
can wait forever on a peer that was killed (its socket closed), so neither the engine's
thread nor a shutdown that joins it would ever return. Nothing in MLX can interrupt such a
wait, and the process cannot run its exit handlers past it (MLX's destructors join the
thread that waits), so this stops the process from outside the wait:

- ``PeerWatch`` (``distributed.peer_watch``) sees a peer's ring connection close, or the
  launcher go: the requests still running fail at once with ``RankLostError`` (a 503, or a
  stream's error event), later ones too, uvicorn is told to stop, and the process ends
  with status 1 once it has (``os._exit``: its exit handlers could wait forever).
- A signal starts uvicorn's graceful stop as on one machine; if requests are still
  running after ``ABANDON_SECONDS`` (just before uvicorn would cut their connections)
  they fail with a clear error, and a process still here after ``STOP_SECONDS`` ends with
  status 1 (its engine's step never ended). A second SIGINT ends it at once (a second
  SIGTERM does not: mlx.launch sends one of its own when a rank exits).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from mlxvlm.distributed.group import RankLostError
from mlxvlm.distributed.peer_watch import PeerWatch
from mlxvlm.distributed.rank_stop import exit_now
from mlxvlm.errors import MlxvlmError

logger = logging.getLogger("mlxvlm.server")

# After a signal: uvicorn waits up to 5 s for responses (listener's graceful shutdown),
# then the engine's close waits for its step.
ABANDON_SECONDS = 4.0
STOP_SECONDS = 10.0


class ServerStopping(MlxvlmError):
    """The server stops before a request's answer ended (a 503)."""


class ShardedStop:
    """Use as ``with ShardedStop(engine, server, rank): server.run(...)`` on rank 0;
    ``server`` is ``listener.guarded_server``'s, whose signals it is told of."""

    def __init__(self, engine: Any, server: Any, rank: int = 0):
        self.engine = engine
        self.server = server
        self.rank = rank
        self.exit_code: int | None = None  # set once the process must end by os._exit
        self._lock = threading.Lock()
        self._signals = 0
        self._timer: threading.Thread | None = None
        self._watch = PeerWatch(rank, self.peer_lost)
        server.on_signal = self.signalled

    def __enter__(self) -> "ShardedStop":
        self._watch.start()
        logger.info("rank %d watches %s: it stops if one is gone", self.rank,
                    self._watch.watched)
        return self

    def __exit__(self, *_: Any) -> None:
        """After uvicorn returned (or raised): a process that lost a peer, or whose engine
        is still inside a step, ends here."""
        self._watch.stop()
        if self.exit_code is None and self.engine.stuck:
            logger.error("stopping: the engine's step did not end (a rank does not answer); "
                         "exiting without releasing the other ranks")
            self.exit_code = 1
        if self.exit_code is not None:
            exit_now(self.exit_code)

    def peer_lost(self, reason: str) -> None:
        """``PeerWatch``'s call (its thread), or a signal's once a peer is seen gone."""
        with self._lock:
            if self.exit_code is not None or self.engine.released:
                return  # (released ranks leave: nothing is lost)
            self.exit_code = 1
        logger.error("stopping: %s", reason)
        failed = self.engine.abandon(RankLostError(
            f"another rank left the run: {reason}; the server is stopping"))
        if failed:
            logger.error("%d request%s failed: rank 0 cannot answer without the other ranks",
                         failed, "" if failed == 1 else "s")
        self.server.should_exit = True
        self._arm()

    def signalled(self, signum: int) -> None:
        """uvicorn's signal handler's call (the main thread), before it starts stopping."""
        name = signal.Signals(signum).name
        self._signals += 1
        if self._signals > 1 and signum == signal.SIGINT:  # (Ctrl-C again, as uvicorn's)
            logger.error("stopping at once on a second SIGINT")
            exit_now(1)
        logger.warning("stopping on %s", name)
        reason = self._watch.lost()
        if reason is not None:  # (off the handler: it may have interrupted a holder of
            # the engine's locks on this thread)
            threading.Thread(target=self.peer_lost, args=(reason,), daemon=True).start()
        self._arm(name)

    def _arm(self, signame: str | None = None) -> None:
        """Start the timer that fails what still runs, then ends the process."""
        with self._lock:
            if self._timer is not None:
                return
            self._timer = threading.Thread(target=self._give_up, args=(signame,),
                                           name="mlxvlm-stop-timer", daemon=True)
        self._timer.start()

    def _give_up(self, signame: str | None) -> None:
        time.sleep(ABANDON_SECONDS)
        if signame is not None:
            failed = self.engine.abandon(ServerStopping(
                f"the server is stopping (on {signame}) before this answer ended"))
            if failed:
                logger.warning("%d request%s still running on %s failed", failed,
                               "" if failed == 1 else "s", signame)
        time.sleep(STOP_SECONDS - ABANDON_SECONDS)
        logger.error("stopping: still here %d s after %s (the engine's step did not end: a "
                     "rank does not answer); exiting without releasing the other ranks",
                     STOP_SECONDS, signame or "a peer was lost")
        exit_now(1)
