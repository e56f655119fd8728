"""Several models behind one server: the models a server may answer with (the ``--model``
values, the checkpoints under ``--models-dir``), each loaded on first use into its own
``GenerationService`` (one engine per loaded model), at most ``max_loaded`` at once.

Everything here runs on the event loop except the load itself, which runs in a worker
thread so that requests to the models already loaded go on while another loads. Requests
for a model being loaded wait for that one load. A request holds a lease on its model
from the moment it is routed until its HTTP exchange ends (``ModelLeases``, streaming
included), and a model is unloaded -- the least recently used first, to make room, or
after ``idle_unload_seconds`` unused -- only once its leases are all given back: no
answer is cut off by an unload.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import mlx.core as mx
from starlette.types import Receive, Scope, Send

from mlxvlm.errors import MlxvlmError
from mlxvlm.media import PixelBudget
from mlxvlm.server.config import ServerConfig
from mlxvlm.server.errors import APIError
from mlxvlm.server.security import HTTPMiddleware
from mlxvlm.server.service import GenerationService, RequestCounters

logger = logging.getLogger("mlxvlm.server")

# (model id, its path or Hub repo) -> (model, processor)
Loader = Callable[[str, str], tuple[Any, Any]]

# Where a request's leases are kept in its ASGI scope (``ModelLeases`` gives them back).
LEASES = "mlxvlm.model_leases"


@dataclass
class LoadedModel:
    service: GenerationService
    load_seconds: float
    last_used: float
    leases: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.drained.set()


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
        self._loaded: OrderedDict[str, LoadedModel] = OrderedDict()
        self._loading: dict[str, asyncio.Future] = {}
        # One load or unload at a time: room is made, then the model is loaded into it.
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
        """The loaded models, least recently used first."""
        return list(self._loaded)

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

    async def acquire(self, model_id: str) -> ModelLease:
        """A lease on ``model_id``'s service, loading the model first if it is not
        loaded (404 for a model this server does not serve; 500 if it fails to load)."""
        if model_id not in self.sources:
            raise self.unknown_model(model_id)
        while True:
            entry = self._loaded.get(model_id)
            if entry is not None:
                entry.leases += 1
                entry.drained.clear()
                entry.last_used = self._clock()
                self._loaded.move_to_end(model_id)
                return ModelLease(self, entry)
            loading = self._loading.get(model_id)
            if loading is None:
                loading = asyncio.ensure_future(self._load(model_id))
                self._loading[model_id] = loading
            # Shielded: a client that goes away does not cancel the load others wait on.
            await asyncio.shield(loading)

    async def lease_for(self, scope: Scope, model_id: str) -> GenerationService:
        """``acquire``, with the lease kept in the request's scope for ``ModelLeases``
        to give back when the exchange ends."""
        lease = await self.acquire(model_id)
        leases = scope.get(LEASES)
        if leases is None:  # outside ModelLeases (not in a server app): nothing would
            lease.release()  # give it back, so it holds nothing
            return lease.service
        leases.append(lease)
        return lease.service

    # -- loading and unloading ---------------------------------------------------------

    async def _load(self, model_id: str) -> None:
        try:
            async with self._changing:
                if model_id in self._loaded:
                    return
                while len(self._loaded) >= self.config.max_loaded_models:
                    await self._unload(next(iter(self._loaded)), "to make room for "
                                       f"{model_id!r} (--max-loaded-models "
                                       f"{self.config.max_loaded_models})")
                logger.info("loading %r from %s", model_id, self.sources[model_id])
                started = time.perf_counter()
                try:
                    service = await asyncio.to_thread(self._build, model_id)
                except MlxvlmError as error:
                    raise APIError(500, f"the model {model_id!r} could not be loaded: {error}",
                                   param="model", code="model_load_failed") from error
                seconds = time.perf_counter() - started
                self._start(model_id, service, seconds)
                logger.info("loaded %r in %.2f s", model_id, seconds)
        finally:
            self._loading.pop(model_id, None)

    def _build(self, model_id: str) -> GenerationService:
        model, processor = self._load_model(model_id, self.sources[model_id])
        return self._service(model_id, model, processor)

    def _service(self, model_id: str, model: Any, processor: Any) -> GenerationService:
        return GenerationService(model, processor, replace(self.config, model_id=model_id),
                                 counters=self.counters, pixels=self.pixels)

    def _start(self, model_id: str, service: GenerationService, load_seconds: float) -> None:
        if self._running:  # else ``start`` starts it
            service.start()
        self._loaded[model_id] = LoadedModel(service, load_seconds, self._clock())
        self.loads += 1

    def _add(self, model_id: str, model: Any, processor: Any, load_seconds: float) -> None:
        self._start(model_id, self._service(model_id, model, processor), load_seconds)

    def preload(self, model_id: str) -> GenerationService:
        """Load ``model_id`` now, before the server starts (no event loop yet)."""
        started = time.perf_counter()
        service = self._build(model_id)
        self._start(model_id, service, time.perf_counter() - started)
        return service

    async def _unload(self, model_id: str, why: str) -> None:
        """Take the model out (new requests for it load it again), wait for its leases,
        then close its engine and give its memory back."""
        entry = self._loaded.pop(model_id)
        if entry.leases:
            logger.info("unloading %r %s, after its %d requests in flight", model_id, why,
                        entry.leases)
        await entry.drained.wait()
        await asyncio.to_thread(entry.service.close)
        # Its arrays are freed with the last reference: the memory is back before the
        # next model loads.
        del entry
        gc.collect()
        mx.clear_cache()
        self.unloads += 1
        logger.info("unloaded %r %s", model_id, why)


    def _give_back(self, entry: LoadedModel) -> None:
        entry.leases -= 1
        entry.last_used = self._clock()
        if entry.leases == 0:
            entry.drained.set()

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

