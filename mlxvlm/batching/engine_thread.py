"""The thread an engine runs its loop on, and the condition its callers wake it with;
shared by the batching engine and the sharded server's engine."""

from __future__ import annotations

import threading
from typing import Any, Callable

from mlxvlm.mlx_threads import clear_streams_when_thread_ends


class EngineThread:
    """``start`` runs the subclass's ``_run`` on a daemon thread named ``thread_name``;
    ``_wake`` and ``_stop_thread`` reach it through ``_cond`` (``_closed`` tells the loop
    to return)."""

    thread_name = "mlxvlm-engine"

    def _init_thread(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the engine on its own thread until ``close``."""
        self._thread = threading.Thread(target=self._thread_main, name=self.thread_name,
                                        daemon=True)
        self._thread.start()

    def _thread_main(self) -> None:
        clear_streams_when_thread_ends()
        self._run()

    def _run(self) -> None:  # the subclass's loop
        raise NotImplementedError

    def _wait_for(self, ready: Callable[[], bool]) -> bool:
        """With ``_cond`` held: wait until ``ready()`` or ``close``; False once closed."""
        while not self._closed and not ready():
            self._cond.wait()
        return not self._closed

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _stop_thread(self, timeout: float | None,
                     take: Callable[[], Any] | None = None) -> Any:
        """Mark the engine closed (``take()`` runs under the same lock: what the caller
        takes back before the loop sees it), wake the loop and wait up to ``timeout``
        for it to return; ``take``'s result."""
        with self._cond:
            self._closed = True
            taken = take() if take is not None else None
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        return taken
