"""The models the chat offers, loaded when chosen: at most ``max_loaded`` at a time
(default one), switched as the server switches them (``model_pool``): a conversation
whose model is not loaded waits, in arrival order; one load serves every conversation
waiting for that model; a model in use keeps its place for ``min_loaded_seconds`` (one
idle for a second gives way at once); a conversation whose client left stops waiting,
and no model is loaded for nobody.

A name is the ``--model`` spelling (a path or a Hub repo id), or a checkpoint folder found
under ``--models-dir``. The pool lives on an event loop of its own, in a thread: Gradio
answers each conversation in a worker thread, and they all wait through it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from mlxvlm.errors import MlxvlmError
from mlxvlm.model_pool import MIN_LOADED_SECONDS, Lease, ModelPool

if TYPE_CHECKING:  # not at run time: the command line loads a model before Gradio
    from mlxvlm.ui.session import ChatSession

log = logging.getLogger(__name__)

# name -> a started ChatSession for it (loads the model)
OpenSession = Callable[[str], "ChatSession"]


class ModelWait:
    """One conversation's wait for a model, then its hold on it, until ``release``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: ModelPool, name: str):
        self.name = name
        self._loop = loop
        self._task: asyncio.Task | None = None
        self._ended = False
        # The lease, handed from the pool's loop to the waiting thread.
        self._granted: concurrent.futures.Future[Lease] = concurrent.futures.Future()
        loop.call_soon_threadsafe(self._begin, pool, name)

    def _begin(self, pool: ModelPool, name: str) -> None:  # on the loop
        if self._ended:
            self._granted.cancel()
            return
        self._task = asyncio.ensure_future(pool.acquire(name))
        self._task.add_done_callback(self._settle)

    def _settle(self, task: asyncio.Task) -> None:  # on the loop
        if task.cancelled():
            self._granted.cancel()
        elif task.exception() is not None:
            self._granted.set_exception(task.exception())
        else:
            self._granted.set_result(task.result())

    def wait(self, timeout: float | None = None) -> ChatSession | None:
        """The model's session once it is this conversation's; None if ``timeout``
        passed first. Raises ``model_pool.PoolError`` (e.g. the model failed to load)."""
        try:
            return self._granted.result(timeout).model
        except concurrent.futures.TimeoutError:
            return None

    def release(self) -> None:
        """Stop waiting, or give the model back (any thread; more than once is fine)."""
        try:
            self._loop.call_soon_threadsafe(self._end)
        except RuntimeError:  # the registry is closed, and its models with it
            pass

    def _end(self) -> None:  # on the loop
        if self._ended:
            return
        self._ended = True
        task = self._task
        if task is None:
            return
        if not task.done():
            # Its client left (Gradio closed the turn): the pool drops the waiter (and
            # gives back a lease granted meanwhile).
            log.info("a conversation left while waiting for %r", self.name)
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            task.result().release()


class ModelRegistry:
    """The offered ``names`` (the first is the one the page starts with); ``wait_for``
    (or ``use``) gives a model's session, loading it (and unloading another) if needed."""

    def __init__(self, names: Sequence[str], open_session: OpenSession, max_loaded: int = 1,
                 min_loaded_seconds: float = MIN_LOADED_SECONDS):
        if not names:
            raise MlxvlmError("give at least one --model (or --models-dir)")
        self.names = list(dict.fromkeys(names))
        self.pool: ModelPool[ChatSession] = ModelPool(
            {name: name for name in self.names}, lambda name, _source: open_session(name),
            close=lambda session: session.close(), max_loaded=max(1, max_loaded),
            min_loaded_seconds=min_loaded_seconds, log=log)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="mlxvlm-ui-models", daemon=True)
        self._thread.start()

    @classmethod
    def of_session(cls, session: ChatSession) -> "ModelRegistry":
        """A registry of one model, already loaded."""

        def cannot_reopen(name: str) -> ChatSession:
            raise MlxvlmError(f"{name} was closed")

        registry = cls([session.model_name], cannot_reopen)
        registry._on_loop(lambda: registry.pool.add(session.model_name, session))
        return registry

    def _on_loop(self, call: Callable):
        """``call()``'s result, run on the pool's loop (its state is the loop's alone)."""
        async def run():
            return call()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    @property
    def loaded(self) -> list[str]:
        return self._on_loop(self.pool.loaded_names)

    def preload(self, name: str) -> None:
        """Load ``name`` now, before any conversation (its loader's errors raised as
        they are)."""
        self._on_loop(lambda: self.pool.preload(name))

    def wait_for(self, name: str) -> ModelWait:
        """Start waiting for ``name``'s session (``MlxvlmError`` for a name not offered);
        the caller ends with ``release``."""
        if name not in self.names:
            raise MlxvlmError(f"{name!r} is not one of this chat's models")
        return ModelWait(self._loop, self.pool, name)

    @contextmanager
    def use(self, name: str) -> Iterator[ChatSession]:
        """``name``'s session (waiting as long as it takes), kept loaded until the block
        ends."""
        wait = self.wait_for(name)
        try:
            yield wait.wait()
        finally:
            wait.release()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._on_loop(self.pool.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
