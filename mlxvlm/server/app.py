"""The FastAPI application, assembled: the models (a registry of services, one engine per
loaded model) and what the routes depend on, the error handlers, the middleware and the
routers."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from mlxvlm.server.config import ServerConfig
from mlxvlm.server.errors import install_error_handlers
from mlxvlm.server.response_store import ResponseStore
from mlxvlm.server.routes import anthropic_messages, chat, models, responses, retrieval, speech
from mlxvlm.server.security import (
    APIKeyMiddleware,
    BodyBudget,
    HostCheckMiddleware,
    allowed_host_names,
)
from mlxvlm.server.models_registry import ModelLeases, ModelRegistry
from mlxvlm.server.status import StatusCounting


def create_app(model: Any, processor: Any, config: ServerConfig) -> FastAPI:
    """A server of one model, already loaded."""
    return create_registry_app(ModelRegistry.serving(model, processor, config))


def create_registry_app(registry: ModelRegistry) -> FastAPI:
    """A server of the registry's models, each loaded on first use."""
    config = registry.config

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        registry.start()
        try:
            yield
        finally:
            registry.close()

    # No interactive docs or schema endpoints: nothing is served that was not asked for.
    app = FastAPI(title="mlxvlm", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    # What the routes' dependencies (``deps``) hand them.
    app.state.models = registry
    app.state.config = config
    app.state.body_budget = BodyBudget(config.max_buffered_body_bytes)
    app.state.response_store = ResponseStore(config.max_stored_responses,
                                             config.max_stored_response_bytes,
                                             config.max_total_stored_response_bytes)
    install_error_handlers(app)
    # Added last = outermost: the Host is checked first (DNS rebinding), then CORS
    # answers preflights before the key is checked.
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version",
                           "anthropic-beta"],
        )
    hosts = allowed_host_names(config.host, config.allowed_hosts)
    if hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed=hosts)
    # Requests give back the models they used once their answer is sent.
    app.add_middleware(ModelLeases)
    # Outside all the others, so that their refusals are counted too.
    app.add_middleware(StatusCounting, counters=registry.counters)
    app.include_router(models.router)
    app.include_router(chat.router)
    app.include_router(anthropic_messages.router)
    app.include_router(responses.router)
    app.include_router(retrieval.router)
    app.include_router(speech.router)
    return app
