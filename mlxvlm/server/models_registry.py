"""Several models behind one server: the models a server may answer with (the ``--model``
values, the checkpoints under ``--models-dir``), each loaded on first use into its own
``GenerationService`` (one engine per loaded model), at most ``max_loaded`` at once.

Everything here runs on the event loop except the load itself, which runs in a worker
thread so that requests to the models already loaded go on while another loads. A request
holds a lease on its model from the moment it is routed until its HTTP exchange ends
(``ModelLeases``, streaming included), and a model is unloaded only once its leases are
all given back: no answer is cut off by an unload.

Switching between models is fair and bounded. A request for a model that is not loaded
waits (``model_waiters``, in arrival order; 429 beyond ``max_concurrency + max_queue``
waiting for one model) and one task, the switcher, does every load and unload: it loads
the model of the oldest waiter, into free room or in place of a loaded model, and hands
all of that model's waiters their leases the moment it is loaded, so that every load
serves the requests it was made for before the model can be unloaded again. A loaded
model in use gives way only after ``min_loaded_seconds`` from its load (the bound on how
often a busy server switches); one with nothing in flight for ``IDLE_SECONDS`` gives way
at once. Giving way, it takes no new requests (they wait), finishes those in flight and
is unloaded. A waiter whose client goes away is dropped, and no model is loaded or given
way for without a live waiter.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

import mlx.core as mx
from starlette.types import Receive, Scope, Send

from mlxvlm.errors import MlxvlmError
from mlxvlm.media import PixelBudget
from mlxvlm.server.config import ServerConfig
from mlxvlm.server.errors import APIError, ClientDisconnected
from mlxvlm.server.model_waiters import ModelWaiters, Waiter
from mlxvlm.server.security import HTTPMiddleware
from mlxvlm.server.service import GenerationService, RequestCounters

logger = logging.getLogger("mlxvlm.server")

# (model id, its path or Hub repo) -> (model, processor)
Loader = Callable[[str, str], tuple[Any, Any]]

# Returns once the request's client has gone away (``lifetime.client_gone``).
ClientGone = Callable[[], Awaitable[None]]

# A loaded model with no request in flight for this long (or ``min_loaded_seconds``, if
# less) is idle: it gives way without waiting for its turn to end. Longer than the gap
# between one client's requests in a row, so that steady use is not taken for idleness.
IDLE_SECONDS = 1.0

# Where a request's leases are kept in its ASGI scope (``ModelLeases`` gives them back).
LEASES = "mlxvlm.model_leases"


@dataclass
class LoadedModel:
    service: GenerationService
    load_seconds: float
    last_used: float
    loaded_at: float
    leases: int = 0
    # Giving way to another model's waiters: new requests for it wait.
    giving_way: bool = False


class ModelLease:
    """One request's hold on its model's service; ``release`` (once) gives it back."""

    def __init__(self, registry: "ModelRegistry", entry: LoadedModel):
        self.service = entry.service
        self._registry = registry
        self._entry: LoadedModel | None = entry

    def release(self) -> None:
        if self._entry is not None:
            self._registry._give_back(self._entry)
            self._entry = None


class ModelRegistry:
    """The served models by id and the loaded ones, least recently used first."""

    def __init__(self, config: ServerConfig, load: Loader, *,
                 clock: Callable[[], float] = time.monotonic):
        """The models are ``config.model_sources``; ``load`` loads one (in a worker
        thread)."""
        if config.max_loaded_models < 1:
            raise MlxvlmError(f"max_loaded_models must be at least 1, got "
                              f"{config.max_loaded_models}")
        self.sources = dict(config.model_sources)
        self.config = config
        self._load_model = load
        self._clock = clock
        self.started_at = time.time()
        # What every model's service shares: the server's answer counts and its budget
        # of decoded pixels.
        self.counters = RequestCounters()
        self.pixels = PixelBudget(config.max_request_pixels, config.max_total_pixels)
        self.loads = 0
        self.unloads = 0
        self.waits_abandoned = 0  # clients gone while their model was not loaded
        self.waits_refused = 0  # 429: too many requests waiting for one model
        self._loaded: OrderedDict[str, LoadedModel] = OrderedDict()
        self._waiters = ModelWaiters()
        self._max_waiting = config.max_concurrency + config.max_queue
        # Set whenever something the switcher decides on changes.
        self._changed = asyncio.Event()
        self._switcher: asyncio.Task | None = None
        # One load or unload at a time (the switcher's, or the idle unload's): the
        # memory of one model is given back before the next one loads.
        self._changing = asyncio.Lock()
        self._idle_task: asyncio.Task | None = None
        self._running = False

    @classmethod
    def serving(cls, model: Any, processor: Any, config: ServerConfig) -> "ModelRegistry":
        """A registry of one model, already loaded (``create_app``'s); it has no loader,
        so it is never unloaded for being idle."""
        registry = cls(replace(config, model_sources={config.model_id: config.model_id},
                               idle_unload_seconds=0.0), _no_loader)
        registry._add(config.model_id, model, processor, load_seconds=0.0)
        return registry

    # -- what the routes ask -----------------------------------------------------------

    def ids(self) -> list[str]:
        return list(self.sources)

    def loaded_ids(self) -> list[str]:
        """The loaded models (those giving way included), least recently used first."""
        return list(self._loaded)

    def waiting(self, model_id: str | None = None) -> int:
        """Requests waiting for ``model_id`` (for any model: None) to be loaded."""
        return self._waiters.count(model_id)

    def service(self, model_id: str) -> GenerationService:
        """The service of a loaded model (``KeyError`` if it is not loaded)."""
        return self._loaded[model_id].service

    def services(self) -> list[tuple[str, GenerationService]]:
        return [(model_id, entry.service) for model_id, entry in self._loaded.items()]

    def unknown_model(self, name: str) -> APIError:
        served = ", ".join(repr(m) for m in self.ids()[:8])
        extra = len(self.sources) - 8
        more = f" and {extra} more (GET /v1/models)" if extra > 0 else ""
        return APIError(404, f"the model {name!r} does not exist; this server serves "
                        f"{served}{more}", param="model", code="model_not_found")

    async def acquire(self, model_id: str, client_gone: ClientGone | None = None
                      ) -> ModelLease:
        """A lease on ``model_id``'s service, once the model is loaded (404 for a model
        this server does not serve; 500 if it fails to load; 429 when too many requests
        wait for it). ``client_gone``: returns when the request's client has left, which
        ends the wait with ``ClientDisconnected``."""
        if model_id not in self.sources:
            raise self.unknown_model(model_id)
        entry = self._loaded.get(model_id)
        if entry is not None and not entry.giving_way:
            return self._lease(model_id, entry)
        if self._waiters.count(model_id) >= self._max_waiting:
            self.waits_refused += 1
            raise APIError(
                429, f"the server is busy ({self._max_waiting} requests already wait for "
                f"the model {model_id!r} to be loaded); retry after a moment",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.config.retry_after_seconds)})
        waiter = self._waiters.add(model_id)
        self._wake()
        try:
            return await _unless_gone(waiter.future, client_gone)
        except ClientDisconnected:
            self.waits_abandoned += 1
            logger.info("a request for %r left while waiting for its model", model_id)
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

    async def lease_for(self, scope: Scope, model_id: str,
                        client_gone: ClientGone | None = None) -> GenerationService:
        """``acquire``, with the lease kept in the request's scope for ``ModelLeases``
        to give back when the exchange ends."""
        lease = await self.acquire(model_id, client_gone)
        leases = scope.get(LEASES)
        if leases is None:  # outside ModelLeases (not in a server app): nothing would
            lease.release()  # give it back, so it holds nothing
            return lease.service
        leases.append(lease)
        return lease.service

    def _lease(self, model_id: str, entry: LoadedModel) -> ModelLease:
        entry.leases += 1
        entry.last_used = self._clock()
        self._loaded.move_to_end(model_id)
        return ModelLease(self, entry)

    def _give_back(self, entry: LoadedModel) -> None:
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
            logger.exception("switching models failed")
            for model_id in self.ids():
                self._waiters.fail(model_id, APIError(
                    500, "switching models failed; see the server log"))

    async def _switch_until_nobody_waits(self) -> None:
        while True:
            self._changed.clear()
            target = self._waiters.oldest_model()
            if target is None:
                for entry in self._loaded.values():
                    entry.giving_way = False
                return
            entry = self._loaded.get(target)
            if entry is not None:  # it was giving way, and is wanted again first
                entry.giving_way = False
                self._waiters.give(target, lambda: self._lease(target, entry))
                continue
            if len(self._loaded) < self.config.max_loaded_models:
                await self._load_for_waiters(target)
                continue
            victim = self._victim()
            if victim is None:  # every loaded model is in use, within its turn
                await self._wait_for_change(self._next_turn_end() - self._clock())
                continue
            entry = self._loaded[victim]
            if not entry.giving_way:
                entry.giving_way = True
                logger.info("%r gives way to %r once its %d requests in flight are done "
                            "(--max-loaded-models %d)", victim, target, entry.leases,
                            self.config.max_loaded_models)
            if entry.leases:
                await self._wait_for_change(None)
                continue
            async with self._changing:
                if victim in self._loaded:  # else the idle unload took it meanwhile
                    await self._unload(victim, f"to make room for {target!r} (--max-"
                                       f"loaded-models {self.config.max_loaded_models})")

    def _victim(self) -> str | None:
        """The loaded model to give way: one already giving way, else the least
        recently used one whose turn is over."""
        for model_id, entry in self._loaded.items():
            if entry.giving_way:
                return model_id
        now = self._clock()
        ended = [(entry.last_used, model_id) for model_id, entry in self._loaded.items()
                 if self._turn_end(entry) <= now]
        return min(ended)[1] if ended else None

    def _turn_end(self, entry: LoadedModel) -> float:
        """When a model's turn ends: ``min_loaded_seconds`` after its load, or once it
        has been idle for ``IDLE_SECONDS``."""
        turn = self.config.min_loaded_seconds
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

    async def _load_for_waiters(self, model_id: str) -> None:
        """Load ``model_id`` and hand each of its waiters a lease at once (the error to
        each when the load fails)."""
        async with self._changing:
            if not self._waiters.count(model_id):  # they left while an unload ran
                return
            logger.info("loading %r from %s for %d waiting requests", model_id,
                        self.sources[model_id], self._waiters.count(model_id))
            started = time.perf_counter()
            try:
                service = await asyncio.to_thread(self._build, model_id)
            except Exception as error:  # noqa: BLE001 -- each waiter gets a 500
                if isinstance(error, MlxvlmError):
                    logger.error("the model %r could not be loaded: %s", model_id, error)
                    why = str(error)
                else:
                    logger.exception("the model %r could not be loaded", model_id)
                    why = "see the server log"
                self._waiters.fail(model_id, APIError(
                    500, f"the model {model_id!r} could not be loaded: {why}",
                    param="model", code="model_load_failed"))
                return
            seconds = time.perf_counter() - started
            entry = self._start(model_id, service, seconds)
            logger.info("loaded %r in %.2f s", model_id, seconds)
            self._waiters.give(model_id, lambda: self._lease(model_id, entry))

    # -- loading and unloading ---------------------------------------------------------

    def _build(self, model_id: str) -> GenerationService:
        model, processor = self._load_model(model_id, self.sources[model_id])
        return self._service(model_id, model, processor)

    def _service(self, model_id: str, model: Any, processor: Any) -> GenerationService:
        return GenerationService(model, processor, replace(self.config, model_id=model_id),
                                 counters=self.counters, pixels=self.pixels)

    def _start(self, model_id: str, service: GenerationService,
               load_seconds: float) -> LoadedModel:
        if self._running:  # else ``start`` starts it
            service.start()
        now = self._clock()
        entry = self._loaded[model_id] = LoadedModel(service, load_seconds, now, now)
        self.loads += 1
        return entry

    def _add(self, model_id: str, model: Any, processor: Any, load_seconds: float) -> None:
        self._start(model_id, self._service(model_id, model, processor), load_seconds)

    def preload(self, model_id: str) -> GenerationService:
        """Load ``model_id`` now, before the server starts (no event loop yet)."""
        started = time.perf_counter()
        service = self._build(model_id)
        self._start(model_id, service, time.perf_counter() - started)
        return service

    async def _unload(self, model_id: str, why: str) -> None:
        """Take the model out (it has no leases) and close its engine, giving its memory
        back."""
        entry = self._loaded.pop(model_id)
        await asyncio.to_thread(entry.service.close)
        # Its arrays are freed with the last reference: the memory is back before the
        # next model loads.
        del entry
        gc.collect()
        mx.clear_cache()
        self.unloads += 1
        logger.info("unloaded %r %s", model_id, why)
        self._wake()

    async def unload_idle(self) -> list[str]:
        """Unload the models unused for ``idle_unload_seconds`` (none when it is 0)."""
        limit = self.config.idle_unload_seconds
        if not limit:
            return []
        async with self._changing:
            now = self._clock()
            idle = [model_id for model_id, entry in self._loaded.items()
                    if entry.leases == 0 and now - entry.last_used >= limit]
            for model_id in idle:
                await self._unload(model_id, f"after {limit:g} s unused "
                                   "(--idle-unload-seconds)")
        return idle

    async def _unload_idle_forever(self) -> None:
        period = max(0.5, min(30.0, self.config.idle_unload_seconds / 4))
        while True:
            await asyncio.sleep(period)
            await self.unload_idle()

    # -- the server's lifespan -----------------------------------------------------------

    def start(self) -> None:
        self._running = True
        for entry in self._loaded.values():
            entry.service.start()
        if self.config.idle_unload_seconds:
            self._idle_task = asyncio.get_running_loop().create_task(
                self._unload_idle_forever())

    def close(self) -> None:
        self._running = False
        if self._idle_task is not None:
            self._idle_task.cancel()
        if self._switcher is not None:
            self._switcher.cancel()
        for model_id in self.ids():
            self._waiters.fail(model_id, APIError(503, "the server is shutting down"))
        for entry in self._loaded.values():
            entry.service.close()
        self._loaded.clear()


def checkpoint_loader(config: ServerConfig, *, revision: str | None = None,
                      adapter_path: str | None = None,
                      trust_remote_code: bool = False) -> Loader:
    """``mlxvlm.load`` with the command line's options (an adapter fits one model only)."""
    if adapter_path is not None and len(config.model_sources) > 1:
        raise MlxvlmError("--adapter-path fits one model; it cannot be used when serving "
                          f"{len(config.model_sources)} models")

    def load_checkpoint(model_id: str, path: str) -> tuple[Any, Any]:
        from mlxvlm.loading import load

        return load(path, revision=revision, adapter_path=adapter_path,
                    trust_remote_code=trust_remote_code)

    return load_checkpoint


async def _unless_gone(granted: asyncio.Future, client_gone: ClientGone | None) -> Any:
    """``granted``'s result, unless ``client_gone`` returns first (``ClientDisconnected``).
    """
    if client_gone is None:
        return await granted
    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({granted, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if granted.done():
        return granted.result()
    raise ClientDisconnected


def _no_loader(model_id: str, path: str) -> tuple[Any, Any]:
    raise MlxvlmError(f"the model {model_id!r} was unloaded and this server cannot load it "
                      "again (it was given already loaded)")


class ModelLeases(HTTPMiddleware):
    """Gives back the model leases a request took, once its whole exchange is over (a
    streamed answer's last event sent, or its client gone)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        leases: list[ModelLease] = []
        scope[LEASES] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in leases:
                lease.release()

