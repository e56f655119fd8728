"""The routes' dependencies: what ``create_app`` put on the application (the models, the
config, the body budget), a request body read and validated, and the service of the model
it names, so that a route only says what it needs."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from mlxvlm.retrieval.use import capabilities
from mlxvlm.server.chat_completions import warn_unknown_fields
from mlxvlm.server.config import ServerConfig
from mlxvlm.server.errors import APIError, validation_error
from mlxvlm.server.lifetime import client_gone
from mlxvlm.server.logprobs import TokenBytes
from mlxvlm.server.models_registry import ModelRegistry
from mlxvlm.server.schemas import ChatCompletionRequest
from mlxvlm.server.security import read_body, require_json
from mlxvlm.server.service import GenerationService


def get_models(request: Request) -> ModelRegistry:
    return request.app.state.models


def get_config(request: Request) -> ServerConfig:
    return request.app.state.config


async def json_body(request: Request, schema: type[BaseModel]) -> BaseModel:
    """The body, read within the server's one body limit (size, deadline, shared budget:
    ``security.read_body``) and validated as ``schema``. Read by hand rather than as a
    FastAPI body parameter, which would read any size before validating."""
    config = get_config(request)
    require_json(request)
    body = await read_body(request, config.max_body_bytes, timeout=config.body_timeout,
                           budget=request.app.state.body_budget)
    try:
        return schema.model_validate_json(body)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


# What each capability's endpoints are, for the 400 that sends a client elsewhere.
ENDPOINTS = {"chat": "/v1/chat/completions", "embed": "/v1/embeddings",
             "rerank": "/v1/rerank"}


def check_capability(service: GenerationService, model_id: str, capability: str) -> None:
    """400 for a request the model cannot answer (a chat request to an embedding model,
    embeddings from a chat model), naming what it does instead."""
    does = capabilities(service.model.retrieval)
    if capability not in does:
        instead = " and ".join(f"{c} ({ENDPOINTS[c]})" for c in does)
        raise APIError(400, f"the model {model_id!r} does not {capability}: it serves "
                       f"{instead}", param="model", code="model_not_supported")


def service_of(body: Callable[[Request], Awaitable[Any]], capability: str = "chat") -> Callable:
    """A dependency: the service of the model that the request read by ``body`` names
    (loaded first if need be, unless the client leaves meanwhile; 404 for a model not
    served; 400 for one without ``capability``), held until the exchange ends."""

    async def model_service(request: Request, parsed: Any = Depends(body)) -> GenerationService:
        service = await get_models(request).lease_for(request.scope, parsed.model,
                                                      lambda: client_gone(request))
        check_capability(service, parsed.model, capability)
        return service

    return model_service


def body_dependencies(schema: type, capability: str = "chat") -> tuple[Callable, Callable]:
    """An endpoint's two dependencies for a body of ``schema``: the body read and
    validated (the fields this server does not know named in the log), and the service
    of the model it names (``service_of``), which must have ``capability`` ("chat",
    "embed", "rerank")."""

    async def read(request: Request) -> Any:
        body = await json_body(request, schema)
        warn_unknown_fields(body)
        return body

    return read, service_of(read, capability)


chat_request, chat_service = body_dependencies(ChatCompletionRequest)


def get_token_bytes(service: GenerationService = Depends(chat_service)) -> TokenBytes:
    return service.token_bytes
