"""Models loaded on demand, at most ``max_loaded`` at once, switched fairly: the core of
the server's registry (``server.models_registry``) and the chat's (``ui.models``).

Everything here runs on one event loop except loading and closing a model, which run in a
worker thread so that requests to the models already loaded go on meanwhile. A request
holds a lease on its model while it uses it, and a model is unloaded only once its leases
are all given back: no answer is cut off by an unload.

Switching between models is fair and bounded. A request for a model that is not loaded
waits (``waiters``, in arrival order; ``TooManyWaiting`` beyond ``max_waiting`` for one
model) and one task, the switcher, does every load and unload: it loads the model of the
oldest waiter, into free room or in place of a loaded model, and hands all of that
model's waiters their leases the moment it is loaded, so that every load serves the
requests it was made for before the model can be unloaded again. A loaded model in use
gives way only after ``min_loaded_seconds`` from its load (the bound on how often a busy
pool switches); one with nothing in flight for ``IDLE_SECONDS`` gives way at once.
Giving way, it takes no new requests (they wait), finishes those in flight and is
unloaded. A waiter whose client goes away (or whose task is cancelled) is dropped, and no
model is loaded or given way for without a live waiter.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, Mapping, TypeVar

import mlx.core as mx

from mlxvlm.errors import MlxvlmError
from mlxvlm.mlx_threads import clear_streams_when_thread_ends
from mlxvlm.model_pool.waiters import ModelWaiters, Waiter

Model = TypeVar("Model")

# (name, its path or Hub repo) -> the loaded model, ready to answer; run in a worker
# thread.
Build = Callable[[str, str], Model]

# Returns once the request's client has gone away.
ClientGone = Callable[[], Awaitable[None]]

# A loaded model with no request in flight for this long (or ``min_loaded_seconds``, if
# less) is idle: it gives way without waiting for its turn to end. Longer than the gap
# between one client's requests in a row, so that steady use is not taken for idleness.
IDLE_SECONDS = 1.0

# How long a model in use keeps its place by default (``--min-loaded-seconds``).
MIN_LOADED_SECONDS = 10.0


class PoolError(MlxvlmError):
    """A request the pool could not give its model."""


class TooManyWaiting(PoolError):
    def __init__(self, name: str, limit: int):
        super().__init__(f"{limit} requests already wait for the model {name!r} to be "
                         "loaded")
        self.name, self.limit = name, limit


class LoadFailed(PoolError):
    """``why``: the loader's one-line error; None for a fault, which is in the log."""

    def __init__(self, name: str, why: str | None):
        super().__init__(f"the model {name!r} could not be loaded: {why or 'see the log'}")
        self.name, self.why = name, why


class SwitchingFailed(PoolError):
    def __init__(self) -> None:
        super().__init__("switching models failed; see the log")


class PoolClosed(PoolError):
    def __init__(self) -> None:
        super().__init__("shutting down")


class ClientLeft(Exception):
    """The request's client went away while it waited for its model."""


@dataclass
class LoadedModel(Generic[Model]):
    model: Model
    load_seconds: float
    last_used: float
    loaded_at: float
    leases: int = 0
    # Giving way to another model's waiters: new requests for it wait.
    giving_way: bool = False


class Lease(Generic[Model]):
    """One request's hold on its loaded model; ``release`` (on the pool's loop; more
    than once is fine) gives it back."""

    def __init__(self, pool: "ModelPool[Model]", entry: LoadedModel[Model]):
        self._pool = pool
        self._entry: LoadedModel[Model] | None = entry

    @property
    def model(self) -> Model:
        if self._entry is None:
            raise RuntimeError("this lease was given back")
        return self._entry.model

    def release(self) -> None:
        # Given back, it holds nothing: a lease kept by mistake does not keep an unloaded
        # model's memory.
        if self._entry is not None:
            self._pool._give_back(self._entry)
            self._entry = None


class ModelPool(Generic[Model]):
    """The models by name and the loaded ones, least recently used first."""

    def __init__(self, sources: Mapping[str, str], build: Build, *,
                 close: Callable[[Model], None],
                 start: Callable[[Model], Any] | None = None,
                 max_loaded: int = 1, min_loaded_seconds: float = MIN_LOADED_SECONDS,
                 idle_unload_seconds: float = 0.0, max_waiting: int | None = None,
                 log: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``sources``: name -> where it loads from; ``build`` loads one (in a worker
        thread), ``close`` frees one; ``start``, if given, is called on each model once
        the pool runs (``start``) and on each loaded afterwards."""
        if max_loaded < 1:
            raise MlxvlmError(f"max_loaded_models must be at least 1, got {max_loaded}")
        self.sources = dict(sources)
        self.max_loaded = max_loaded
        self.min_loaded_seconds = min_loaded_seconds
        self.idle_unload_seconds = idle_unload_seconds
        self.max_waiting = max_waiting
        self._build = build
        self._close_model = close
        self._start_model = start
        self._log = log or logging.getLogger(__name__)
        self._clock = clock
        self.loads = 0
        self.unloads = 0
        self.waits_abandoned = 0  # clients gone while their model was not loaded
        self.waits_refused = 0  # too many requests waiting for one model
        self._loaded: OrderedDict[str, LoadedModel[Model]] = OrderedDict()
        self._waiters = ModelWaiters()
        # Set whenever something the switcher decides on changes.
        self._changed = asyncio.Event()
        self._switcher: asyncio.Task | None = None
        # One load or unload at a time (the switcher's, or the idle unload's): the
        # memory of one model is given back before the next one loads.
        self._changing = asyncio.Lock()
        self._idle_task: asyncio.Task | None = None
        self._running = False

    # -- what requests ask -------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self.sources)

    def loaded_names(self) -> list[str]:
        """The loaded models (those giving way included), least recently used first."""
        return list(self._loaded)

    def waiting(self, name: str | None = None) -> int:
        """Requests waiting for ``name`` (for any model: None) to be loaded."""
        return self._waiters.count(name)

    def get(self, name: str) -> Model:
        """A loaded model (``KeyError`` if it is not loaded)."""
        return self._loaded[name].model

    def items(self) -> list[tuple[str, Model]]:
        return [(name, entry.model) for name, entry in self._loaded.items()]

    async def acquire(self, name: str, client_gone: ClientGone | None = None) -> Lease[Model]:
        """A lease on ``name`` (one of ``sources``), once it is loaded. Raises
        ``TooManyWaiting``, ``LoadFailed``, ``SwitchingFailed``, ``PoolClosed``, and
        ``ClientLeft`` when ``client_gone`` returns first."""
        if name not in self.sources:
            raise KeyError(name)
        entry = self._loaded.get(name)
        if entry is not None and not entry.giving_way:
            return self._lease(name, entry)
        if self.max_waiting is not None and self._waiters.count(name) >= self.max_waiting:
            self.waits_refused += 1
            raise TooManyWaiting(name, self.max_waiting)
        waiter = self._waiters.add(name)
        self._wake()
        try:
            return await _unless_gone(waiter.future, client_gone)
        except ClientLeft:
            self.waits_abandoned += 1
            self._log.info("a request for %r left while waiting for its model", name)
            self._drop(waiter)
            raise
        except BaseException:
            self._drop(waiter)
            raise

    def _drop(self, waiter: Waiter) -> None:
        """A waiter gone before it could take its lease (its client left, its task was
        cancelled): out of the queue, and a lease granted meanwhile given back."""
        self._waiters.discard(waiter)
        future = waiter.future
        if not future.done():
            future.cancel()
        elif not future.cancelled() and future.exception() is None:
            future.result().release()
        self._wake()

    def _lease(self, name: str, entry: LoadedModel[Model]) -> Lease[Model]:
        entry.leases += 1
        entry.last_used = self._clock()
        self._loaded.move_to_end(name)
        return Lease(self, entry)

    def _give_back(self, entry: LoadedModel[Model]) -> None:
        entry.leases -= 1
        entry.last_used = self._clock()
        if entry.leases == 0:
            self._wake()

    # -- the switcher: every load and unload for waiting requests -----------------------

    def _wake(self) -> None:
        self._changed.set()
        if self._waiters.count() and (self._switcher is None or self._switcher.done()):
            self._switcher = asyncio.get_running_loop().create_task(self._switch())

    async def _switch(self) -> None:
        """Until nobody waits: serve the oldest waiter's model, loading it (into free
        room, or in place of a model whose turn is over and whose requests are done)."""
        try:
            await self._switch_until_nobody_waits()
        except asyncio.CancelledError:
            raise
        except Exception:  # a fault here must not leave requests waiting for ever
            self._log.exception("switching models failed")
            for name in self.names():
                self._waiters.fail(name, SwitchingFailed())

    async def _switch_until_nobody_waits(self) -> None:
        while True:
            self._changed.clear()
            target = self._waiters.oldest_model()
            if target is None:
                for entry in self._loaded.values():
                    entry.giving_way = False
                return
            # (No loaded model is held in a local here: an unloaded one must be freed by
            # the collection right after its unload.)
            if target in self._loaded:  # it was giving way, and is wanted again first
                self._loaded[target].giving_way = False
                self._waiters.give(target, lambda: self._lease(target, self._loaded[target]))
                continue
            if len(self._loaded) < self.max_loaded:
                await self._load_for_waiters(target)
                continue
            victim = self._victim()
            if victim is None:  # every loaded model is in use, within its turn
                await self._wait_for_change(self._next_turn_end() - self._clock())
                continue
            if self._give_way(victim, target):
                await self._wait_for_change(None)  # until its requests in flight are done
                continue
            async with self._changing:
                if victim in self._loaded:  # else the idle unload took it meanwhile
                    await self._unload(victim, f"to make room for {target!r} (--max-"
                                       f"loaded-models {self.max_loaded})")

    def _give_way(self, victim: str, target: str) -> int:
        """``victim`` takes no new requests, to make room for ``target``; its requests
        still in flight."""
        entry = self._loaded[victim]
        if not entry.giving_way:
            entry.giving_way = True
            self._log.info("%r gives way to %r once its %d requests in flight are done "
                           "(--max-loaded-models %d)", victim, target, entry.leases,
                           self.max_loaded)
        return entry.leases

    def _victim(self) -> str | None:
        """The loaded model to give way: one already giving way, else the least
        recently used one whose turn is over."""
        for name, entry in self._loaded.items():
            if entry.giving_way:
                return name
        now = self._clock()
        ended = [(entry.last_used, name) for name, entry in self._loaded.items()
                 if self._turn_end(entry) <= now]
        return min(ended)[1] if ended else None

    def _turn_end(self, entry: LoadedModel[Model]) -> float:
        """When a model's turn ends: ``min_loaded_seconds`` after its load, or once it
        has been idle for ``IDLE_SECONDS``."""
        turn = self.min_loaded_seconds
        end = entry.loaded_at + turn
        if entry.leases == 0:
            end = min(end, entry.last_used + min(IDLE_SECONDS, turn))
        return end

    def _next_turn_end(self) -> float:
        return min(self._turn_end(entry) for entry in self._loaded.values())

    async def _wait_for_change(self, timeout: float | None) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _load_for_waiters(self, name: str) -> None:
        """Load ``name`` and hand each of its waiters a lease at once (``LoadFailed`` to
        each when the load fails)."""
        async with self._changing:
            if not self._waiters.count(name):  # they left while an unload ran
                return
            self._log.info("loading %r from %s for %d waiting requests", name,
                           self.sources[name], self._waiters.count(name))
            started = time.perf_counter()
            try:
                model = await asyncio.to_thread(self._build_on_worker, name, self.sources[name])
            except Exception as error:  # noqa: BLE001 -- each waiter gets LoadFailed
                if isinstance(error, MlxvlmError):
                    self._log.error("the model %r could not be loaded: %s", name, error)
                    why = str(error)
                else:
                    self._log.exception("the model %r could not be loaded", name)
                    why = None
                self._waiters.fail(name, LoadFailed(name, why))
                return
            seconds = time.perf_counter() - started
            entry = self._start(name, model, seconds)
            self._log.info("loaded %r in %.2f s", name, seconds)
            self._waiters.give(name, lambda: self._lease(name, entry))

    # -- loading and unloading ---------------------------------------------------------

    def _start(self, name: str, model: Model, load_seconds: float) -> LoadedModel[Model]:
        if self._running and self._start_model is not None:  # else ``start`` starts it
            self._start_model(model)
        now = self._clock()
        entry = self._loaded[name] = LoadedModel(model, load_seconds, now, now)
        self.loads += 1
        return entry

    def add(self, name: str, model: Model, load_seconds: float = 0.0) -> None:
        """``name``, loaded already (no event loop needed)."""
        self._start(name, model, load_seconds)

    # Loading and closing run on the event loop's default executor, whose workers
    # outlive them: MLX's per-thread state goes with each worker (mlx_threads).
    def _build_on_worker(self, name: str, source: str) -> Model:
        clear_streams_when_thread_ends()
        return self._build(name, source)

    def _close_on_worker(self, model: Model) -> None:
        clear_streams_when_thread_ends()
        self._close_model(model)

    def preload(self, name: str) -> Model:
        """Load ``name`` now, before the pool's loop runs."""
        started = time.perf_counter()
        model = self._build(name, self.sources[name])
        self._start(name, model, time.perf_counter() - started)
        return model

    async def _unload(self, name: str, why: str) -> None:
        """Take the model out (it has no leases) and close it, giving its memory back."""
        entry = self._loaded.pop(name)
        await asyncio.to_thread(self._close_on_worker, entry.model)
        # Its arrays are freed with the last reference: the memory is back before the
        # next model loads.
        del entry
        gc.collect()
        mx.clear_cache()
        self.unloads += 1
        self._log.info("unloaded %r %s", name, why)
        self._wake()

    async def unload_idle(self) -> list[str]:
        """Unload the models unused for ``idle_unload_seconds`` (none when it is 0)."""
        limit = self.idle_unload_seconds
        if not limit:
            return []
        async with self._changing:
            now = self._clock()
            idle = [name for name, entry in self._loaded.items()
                    if entry.leases == 0 and now - entry.last_used >= limit]
            for name in idle:
                await self._unload(name, f"after {limit:g} s unused "
                                   "(--idle-unload-seconds)")
        return idle

    async def _unload_idle_forever(self) -> None:
        period = max(0.5, min(30.0, self.idle_unload_seconds / 4))
        while True:
            await asyncio.sleep(period)
            await self.unload_idle()

    # -- the pool's life (on its loop) ---------------------------------------------------

    def start(self) -> None:
        self._running = True
        if self._start_model is not None:
            for entry in self._loaded.values():
                self._start_model(entry.model)
        if self.idle_unload_seconds:
            self._idle_task = asyncio.get_running_loop().create_task(
                self._unload_idle_forever())

    def close(self) -> None:
        self._running = False
        if self._idle_task is not None:
            self._idle_task.cancel()
        if self._switcher is not None:
            self._switcher.cancel()
        for name in self.names():
            self._waiters.fail(name, PoolClosed())
        for entry in self._loaded.values():
            self._close_model(entry.model)
        self._loaded.clear()


async def _unless_gone(granted: asyncio.Future, client_gone: ClientGone | None) -> Any:
    """``granted``'s result, unless ``client_gone`` returns first (``ClientLeft``)."""
    if client_gone is None:
        return await granted
    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({granted, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if granted.done():
        return granted.result()
    raise ClientLeft
