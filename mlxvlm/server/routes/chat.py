"""``POST /v1/chat/completions``: a validated request through admission, preparation and
the engine to OpenAI's body or its stream of chunks, within one ``RequestLifetime``."""

from __future__ import annotations

import logging
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from mlxvlm.batching import BatchStep
from mlxvlm.errors import MlxvlmError, PromptTooLongError
from mlxvlm.media import MediaError, PixelBudgetError
from mlxvlm.sampling_defaults import checkpoint_defaults
from mlxvlm.server.chat import (
    SSE_DONE,
    CompletionWriter,
    sampling_options,
    sse,
    to_messages,
    warn_unknown_fields,
)
from mlxvlm.server.deps import chat_request, get_service, get_token_bytes, get_vocab_size
from mlxvlm.server.errors import APIError, error_body
from mlxvlm.server.lifetime import RequestLifetime
from mlxvlm.server.logprobs import TokenBytes, logprob_content
from mlxvlm.server.routes.models import unknown_model
from mlxvlm.server.schemas import ChatCompletionRequest
from mlxvlm.server.security import KEY_ID
from mlxvlm.server.service import GenerationService, TokenStream

logger = logging.getLogger("mlxvlm.server")

router = APIRouter()


def as_api_error(error: Exception) -> APIError:
    """A user-input error from preparing or running a request, as a 400 (including a
    chat template that refuses the conversation, e.g. roles out of order)."""
    if isinstance(error, PromptTooLongError):
        return APIError(400, str(error), param="messages", code="context_length_exceeded")
    if isinstance(error, PixelBudgetError) and error.shared:
        return APIError(429, str(error), code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(error, PixelBudgetError):
        return APIError(400, str(error), param="messages", code="too_many_pixels")
    if isinstance(error, MediaError):
        return APIError(400, str(error), param="messages", code="invalid_media")
    return APIError(400, str(error), param="messages")


@router.post("/v1/chat/completions")
async def chat_completions(
    request: Request,
    chat: ChatCompletionRequest = Depends(chat_request),
    service: GenerationService = Depends(get_service),
    token_bytes: TokenBytes = Depends(get_token_bytes),
    vocab_size: int = Depends(get_vocab_size),
) -> Response:
    config = service.config
    if chat.model != config.model_id:
        raise unknown_model(config, chat.model)
    warn_unknown_fields(chat)
    options = sampling_options(chat, config.max_tokens, vocab_size,
                               checkpoint_defaults(service.processor))
    with RequestLifetime(service, request) as life:
        try:
            # With API keys, prefix reuse stays within the key (cached_tokens would
            # otherwise tell one client what another sent).
            namespace = request.scope.get("state", {}).get(KEY_ID)
            prepared = await life.until_disconnect(
                service.prepare(to_messages(chat), namespace))
            stream = life.submit(prepared, options)
            # Wait for the first token before answering, so that a request that fails
            # in prefill still gets a proper error status.
            first = await life.until_disconnect(stream.__anext__())
            writer = CompletionWriter(config.model_id)
            if not chat.stream:
                body = _collect(token_bytes, writer, first, stream, chat.logprobs)
                return JSONResponse(await life.until_disconnect(body))
        except (MlxvlmError, ValueError, TemplateError) as error:
            raise as_api_error(error) from error
        include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
        return life.event_stream(
            _stream_events(token_bytes, writer, first, stream, include_usage, chat.logprobs))


async def _collect(token_bytes: TokenBytes, writer: CompletionWriter, first: BatchStep,
                   stream: TokenStream, want_logprobs: bool | None) -> dict:
    texts, logprobs, step = [], [], first
    while True:
        texts.append(step.text)
        if want_logprobs:
            logprobs.append(logprob_content(token_bytes, step))
        if step.finish_reason is not None:
            break
        step = await stream.__anext__()
    return writer.body("".join(texts), step, logprobs if want_logprobs else None)


async def _stream_events(token_bytes: TokenBytes, writer: CompletionWriter, first: BatchStep,
                         stream: TokenStream, include_usage: bool,
                         want_logprobs: bool | None) -> AsyncIterator[str]:
    yield writer.chunk({"role": "assistant", "content": ""}, include_usage=include_usage)
    step = first
    try:
        while True:
            logprobs = [logprob_content(token_bytes, step)] if want_logprobs else None
            if step.text or logprobs:
                yield writer.chunk({"content": step.text}, logprobs=logprobs,
                                   include_usage=include_usage)
            if step.finish_reason is not None:
                break
            step = await stream.__anext__()
    except Exception as error:  # headers are sent: the failure goes as an error event
        logger.exception("generation failed while streaming")
        status = 400 if isinstance(error, (MlxvlmError, ValueError)) else 500
        message = str(error) if status == 400 else "generation failed; see the server log"
        yield sse(error_body(status, message))
        return
    yield writer.chunk({}, finish_reason=step.finish_reason, include_usage=include_usage)
    if include_usage:
        yield writer.usage_chunk(step)
    yield SSE_DONE
