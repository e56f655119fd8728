"""The routes' dependencies: what ``create_app`` put on the application (the models, the
config, the body budget), a request body read and validated, and the service of the model
it names, so that a route only says what it needs."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from mlxvlm.server.chat_completions import warn_unknown_fields
from mlxvlm.server.config import ServerConfig
from mlxvlm.server.errors import validation_error
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


def service_of(body: Callable[[Request], Awaitable[Any]]) -> Callable:
    """A dependency: the service of the model that the request read by ``body`` names
    (loaded first if need be, unless the client leaves meanwhile; 404 for a model not
    served), held until the exchange ends."""

    async def model_service(request: Request, parsed: Any = Depends(body)) -> GenerationService:
        return await get_models(request).lease_for(request.scope, parsed.model,
                                                   lambda: client_gone(request))

    return model_service


def body_dependencies(schema: type) -> tuple[Callable, Callable]:
    """An endpoint's two dependencies for a body of ``schema``: the body read and
    validated (the fields this server does not know named in the log), and the service
    of the model it names (``service_of``)."""

    async def read(request: Request) -> Any:
        body = await json_body(request, schema)
        warn_unknown_fields(body)
        return body

    return read, service_of(read)


chat_request, chat_service = body_dependencies(ChatCompletionRequest)


def get_token_bytes(service: GenerationService = Depends(chat_service)) -> TokenBytes:
    return service.token_bytes
