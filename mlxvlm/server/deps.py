"""The routes' dependencies: what ``create_app`` put on the application (the service, the
body budget, the tokenizer's bytes) and a request body read and validated, so that a
route only says what it needs."""

from __future__ import annotations

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from mlxvlm.server.config import ServerConfig
from mlxvlm.server.errors import validation_error
from mlxvlm.server.logprobs import TokenBytes
from mlxvlm.server.schemas import ChatCompletionRequest
from mlxvlm.server.security import read_body, require_json
from mlxvlm.server.service import GenerationService


def get_service(request: Request) -> GenerationService:
    return request.app.state.service


def get_config(service: GenerationService = Depends(get_service)) -> ServerConfig:
    return service.config


def get_token_bytes(request: Request) -> TokenBytes:
    return request.app.state.token_bytes


async def json_body(request: Request, schema: type[BaseModel]) -> BaseModel:
    """The body, read within the server's one body limit (size, deadline, shared budget:
    ``security.read_body``) and validated as ``schema``. Read by hand rather than as a
    FastAPI body parameter, which would read any size before validating."""
    config: ServerConfig = get_service(request).config
    require_json(request)
    body = await read_body(request, config.max_body_bytes, timeout=config.body_timeout,
                           budget=request.app.state.body_budget)
    try:
        return schema.model_validate_json(body)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


async def chat_request(request: Request) -> ChatCompletionRequest:
    return await json_body(request, ChatCompletionRequest)
