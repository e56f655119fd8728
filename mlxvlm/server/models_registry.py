"""Several models behind one server: the models a server may answer with (the ``--model``
values, the checkpoints under ``--models-dir``), each loaded on first use into its own
``GenerationService`` (one engine per loaded model), at most ``max_loaded`` at once.

Loading, unloading and the fair switching between models are ``model_pool``'s (shared
with the chat UI); this adds what is the server's: the services and what they share, the
API's errors (404 for a model not served, 429 when too many requests wait for one, 500
when a load fails, 503 at shutdown), and ``ModelLeases``, which keeps a request's lease
from the moment it is routed until its HTTP exchange ends (streaming included), so that
no answer is cut off by an unload.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Awaitable, Callable

from starlette.types import Receive, Scope, Send

from mlxvlm.errors import MlxvlmError
from mlxvlm.media import PixelBudget
from mlxvlm.model_pool import (ClientLeft, Lease, LoadFailed, ModelPool, PoolClosed,
                               SwitchingFailed, TooManyWaiting)
from mlxvlm.server.config import ServerConfig
from mlxvlm.server.errors import APIError, ClientDisconnected
from mlxvlm.server.security import HTTPMiddleware
from mlxvlm.server.service import GenerationService, RequestCounters

logger = logging.getLogger("mlxvlm.server")

# (model id, its path or Hub repo) -> (model, processor)
Loader = Callable[[str, str], tuple[Any, Any]]

# Returns once the request's client has gone away (``lifetime.client_gone``).
ClientGone = Callable[[], Awaitable[None]]

# Where a request's leases are kept in its ASGI scope (``ModelLeases`` gives them back).
LEASES = "mlxvlm.model_leases"


class ModelRegistry:
    """The served models by id and the loaded ones' services, least recently used
    first."""

    def __init__(self, config: ServerConfig, load: Loader, *,
                 clock: Callable[[], float] = time.monotonic):
        """The models are ``config.model_sources``; ``load`` loads one (in a worker
        thread)."""
        self.sources = dict(config.model_sources)
        self.config = config
        self._load_model = load
        self.started_at = time.time()
        # Model id -> what its checkpoint does, read once before it is loaded.
        self._capabilities: dict[str, tuple[str, ...] | None] = {}
        # What every model's service shares: the server's answer counts and its budget
        # of decoded pixels.
        self.counters = RequestCounters()
        self.pixels = PixelBudget(config.max_request_pixels, config.max_total_pixels)
        self.pool: ModelPool[GenerationService] = ModelPool(
            self.sources, self._build, close=GenerationService.close,
            start=GenerationService.start, max_loaded=config.max_loaded_models,
            min_loaded_seconds=config.min_loaded_seconds,
            idle_unload_seconds=config.idle_unload_seconds,
            max_waiting=config.max_concurrency + config.max_queue, log=logger, clock=clock)

    @classmethod
    def serving(cls, model: Any, processor: Any, config: ServerConfig) -> "ModelRegistry":
        """A registry of one model, already loaded (``create_app``'s); it has no loader,
        so it is never unloaded for being idle."""
        registry = cls(replace(config, model_sources={config.model_id: config.model_id},
                               idle_unload_seconds=0.0), _no_loader)
        registry.pool.add(config.model_id,
                          registry._service(config.model_id, model, processor))
        return registry

    # -- what the routes ask -----------------------------------------------------------

    @property
    def loads(self) -> int:
        return self.pool.loads

    @property
    def unloads(self) -> int:
        return self.pool.unloads

    @property
    def waits_abandoned(self) -> int:
        """Clients gone while their model was not loaded."""
        return self.pool.waits_abandoned

    @property
    def waits_refused(self) -> int:
        """429s: too many requests waiting for one model."""
        return self.pool.waits_refused

    def ids(self) -> list[str]:
        return list(self.sources)

    def loaded_ids(self) -> list[str]:
        """The loaded models (those giving way included), least recently used first."""
        return self.pool.loaded_names()

    def waiting(self, model_id: str | None = None) -> int:
        """Requests waiting for ``model_id`` (for any model: None) to be loaded."""
        return self.pool.waiting(model_id)

    def service(self, model_id: str) -> GenerationService:
        """The service of a loaded model (``KeyError`` if it is not loaded)."""
        return self.pool.get(model_id)

    def services(self) -> list[tuple[str, GenerationService]]:
        return self.pool.items()

    def capabilities(self, model_id: str) -> list[str] | None:
        """What the model does ("chat", "embed", "rerank"): its loaded use's, else its
        checkpoint's as loading would detect it, read from the local directory or the
        Hugging Face cache without loading it (None: not known before it is loaded, a
        Hub repo not downloaded yet)."""
        from mlxvlm.retrieval.use import capabilities

        try:
            return list(capabilities(self.pool.get(model_id).model.retrieval))
        except KeyError:
            pass
        if model_id not in self._capabilities:
            self._capabilities[model_id] = checkpoint_capabilities(self.sources[model_id])
        found = self._capabilities[model_id]
        return None if found is None else list(found)

    def unknown_model(self, name: str) -> APIError:
        served = ", ".join(repr(m) for m in self.ids()[:8])
        extra = len(self.sources) - 8
        more = f" and {extra} more (GET /v1/models)" if extra > 0 else ""
        return APIError(404, f"the model {name!r} does not exist; this server serves "
                        f"{served}{more}", param="model", code="model_not_found")

    async def acquire(self, model_id: str, client_gone: ClientGone | None = None
                      ) -> Lease[GenerationService]:
        """A lease on ``model_id``'s service, once the model is loaded (404 for a model
        this server does not serve; 500 if it fails to load; 429 when too many requests
        wait for it). ``client_gone``: returns when the request's client has left, which
        ends the wait with ``ClientDisconnected``."""
        if model_id not in self.sources:
            raise self.unknown_model(model_id)
        try:
            return await self.pool.acquire(model_id, client_gone)
        except ClientLeft:
            raise ClientDisconnected from None
        except TooManyWaiting as error:
            raise APIError(
                429, f"the server is busy ({error.limit} requests already wait for the "
                f"model {model_id!r} to be loaded); retry after a moment",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.config.retry_after_seconds)}) from None
        except LoadFailed as error:
            raise APIError(500, f"the model {model_id!r} could not be loaded: "
                           f"{error.why or 'see the server log'}",
                           param="model", code="model_load_failed") from None
        except SwitchingFailed:
            raise APIError(500, "switching models failed; see the server log") from None
        except PoolClosed:
            raise APIError(503, "the server is shutting down") from None

    async def lease_for(self, scope: Scope, model_id: str,
                        client_gone: ClientGone | None = None) -> GenerationService:
        """``acquire``, with the lease kept in the request's scope for ``ModelLeases``
        to give back when the exchange ends."""
        lease = await self.acquire(model_id, client_gone)
        leases = scope.get(LEASES)
        if leases is None:  # outside ModelLeases (not in a server app): nothing would
            lease.release()  # give it back, so it holds nothing
            return lease.model
        leases.append(lease)
        return lease.model

    # -- loading -----------------------------------------------------------------------

    def _build(self, model_id: str, source: str) -> GenerationService:
        model, processor = self._load_model(model_id, source)
        return self._service(model_id, model, processor)

    def _service(self, model_id: str, model: Any, processor: Any) -> GenerationService:
        return GenerationService(model, processor, replace(self.config, model_id=model_id),
                                 counters=self.counters, pixels=self.pixels)

    def preload(self, model_id: str) -> GenerationService:
        """Load ``model_id`` now, before the server starts (no event loop yet)."""
        return self.pool.preload(model_id)

    async def unload_idle(self) -> list[str]:
        """Unload the models unused for ``idle_unload_seconds`` (none when it is 0)."""
        return await self.pool.unload_idle()

    # -- the server's lifespan -----------------------------------------------------------

    def start(self) -> None:
        self.pool.start()

    def close(self) -> None:
        self.pool.close()


def checkpoint_loader(config: ServerConfig, *, revision: str | None = None,
                      adapter_path: str | None = None,
                      trust_remote_code: bool = False) -> Loader:
    """``mlxvlm.load`` with the command line's options (an adapter fits one model only)."""
    if adapter_path is not None and len(config.model_sources) > 1:
        raise MlxvlmError("--adapter-path fits one model; it cannot be used when serving "
                          f"{len(config.model_sources)} models")

    def load_checkpoint(model_id: str, path: str) -> tuple[Any, Any]:
        from mlxvlm.checkpoint.loading import load

        return load(path, revision=revision, adapter_path=adapter_path,
                    trust_remote_code=trust_remote_code)

    return load_checkpoint


def checkpoint_capabilities(source: str) -> tuple[str, ...] | None:
    """What the checkpoint at ``source`` (a directory, or a Hub repo in the local cache)
    does, from its config.json and the files beside it; None where neither is found."""
    import json
    from pathlib import Path

    from mlxvlm.retrieval.detection import detect_use
    from mlxvlm.retrieval.use import capabilities

    path = Path(source).expanduser()
    config_file = path / "config.json"
    if not path.is_dir():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(source, "config.json")
        except Exception:  # not a repo id
            return None
        if not isinstance(cached, str):
            return None
        config_file = Path(cached)
    try:
        config = json.loads(config_file.read_text())
        return capabilities(detect_use(config, config_file.parent))
    except (OSError, ValueError):
        return None


def _no_loader(model_id: str, path: str) -> tuple[Any, Any]:
    raise MlxvlmError(f"the model {model_id!r} was unloaded and this server cannot load it "
                      "again (it was given already loaded)")


class ModelLeases(HTTPMiddleware):
    """Gives back the model leases a request took, once its whole exchange is over (a
    streamed answer's last event sent, or its client gone)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        leases: list[Lease] = []
        scope[LEASES] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in leases:
                lease.release()

