"""The FastAPI application: routes, middleware and the engine's lifetime."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from mlxvlm.batching import BatchStep
from mlxvlm.errors import MlxvlmError, PromptTooLongError
from mlxvlm.media import MediaError, PixelBudgetError
from mlxvlm.sampling_defaults import checkpoint_defaults
from mlxvlm.server import metrics
from mlxvlm.server.chat import (
    SSE_DONE,
    CompletionWriter,
    sampling_options,
    sse,
    to_messages,
    warn_unknown_fields,
)
from mlxvlm.server.config import ServerConfig
from mlxvlm.server.errors import (
    APIError,
    ClientDisconnected,
    error_body,
    install_error_handlers,
)
from mlxvlm.server.logprobs import TokenBytes, logprob_content
from mlxvlm.server.schemas import ChatCompletionRequest
from mlxvlm.server.security import (
    KEY_ID,
    APIKeyMiddleware,
    BodyBudget,
    HostCheckMiddleware,
    allowed_host_names,
    read_body,
    require_json,
)
from mlxvlm.server.service import GenerationService, TokenStream

logger = logging.getLogger("mlxvlm.server")

# Status recorded for a request whose client went away (nginx's convention).
CLIENT_CLOSED = 499


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable) -> Any:
    """``await work``, unless the client disconnects first: then cancel it and raise
    ``ClientDisconnected``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnected


def validation_error(error: ValidationError) -> APIError:
    """The most specific problem: for a value that may take several shapes (a string or
    a list of parts), the error deepest inside it says what is wrong."""
    first = max(error.errors(), key=lambda e: len(e["loc"]))
    # Drop pydantic's union-branch labels ("str", "list[...]", tag names) from the path.
    path = [str(p) for p in first["loc"] if isinstance(p, int) or p.isidentifier()]
    path = [p for p in path if p not in ("str", "list", "dict")]
    param = ".".join(path) or None
    message = first["msg"]
    return APIError(400, f"{param}: {message}" if param else message, param=param)


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


class EventStreamResponse(StreamingResponse):
    """Server-sent events that run ``on_close`` however the stream ends: finished,
    failed, or abandoned by the client (before or while streaming)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


def create_app(model: Any, processor: Any, config: ServerConfig) -> FastAPI:
    service = GenerationService(model, processor, config)
    token_bytes = TokenBytes(service.engine.tokenizer)
    vocab_size = len(processor.tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        service.start()
        try:
            yield
        finally:
            service.close()

    # No interactive docs or schema endpoints: nothing is served that was not asked for.
    app = FastAPI(title="mlxvlm", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service = service
    install_error_handlers(app)
    body_budget = BodyBudget(config.max_buffered_body_bytes)
    app.state.body_budget = body_budget
    # Added last = outermost: the Host is checked first (DNS rebinding), then CORS
    # answers preflights before the key is checked.
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    hosts = allowed_host_names(config.host, config.allowed_hosts)
    if hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed=hosts)

    model_card = {
        "id": config.model_id,
        "object": "model",
        "created": int(service.started_at),
        "owned_by": "mlxvlm",
    }

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id != config.model_id:
            raise _unknown_model(model_id)
        return model_card

    @app.get("/metrics")
    async def get_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render_metrics(service), media_type=metrics.CONTENT_TYPE)

    def _unknown_model(name: str) -> APIError:
        return APIError(
            404,
            f"the model {name!r} does not exist; this server serves {config.model_id!r}",
            param="model",
            code="model_not_found",
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        status = 500
        try:
            response = await _chat_completions(request)
            status = response.status_code
            return response
        except APIError as error:
            status = error.status
            raise
        except ClientDisconnected:
            logger.info("client went away before its answer was ready")
            status = CLIENT_CLOSED
            return Response(status_code=CLIENT_CLOSED)
        finally:
            service.counters.count(status)

    async def _chat_completions(request: Request) -> Response:
        require_json(request)
        body = await read_body(request, config.max_body_bytes, timeout=config.body_timeout,
                               budget=body_budget)
        try:
            chat = ChatCompletionRequest.model_validate_json(body)
        except ValidationError as error:
            raise validation_error(error) from None
        if chat.model != config.model_id:
            raise _unknown_model(chat.model)
        warn_unknown_fields(chat)
        options = sampling_options(chat, config.max_tokens, vocab_size,
                                   checkpoint_defaults(processor))
        if not service.try_admit():
            raise APIError(
                429,
                f"the server is busy ({service.in_flight} requests in flight, at most "
                f"{service.capacity}); retry after a moment",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(config.retry_after_seconds)},
            )
        stream: TokenStream | None = None
        handed_over = False
        try:
            try:
                # With API keys, prefix reuse stays within the key (cached_tokens would
                # otherwise tell one client what another sent).
                namespace = request.scope.get("state", {}).get(KEY_ID)
                prepared = await until_disconnect(
                    request, service.prepare(to_messages(chat), namespace))
                stream = service.submit(prepared, options)
                # Wait for the first token before answering, so that a request that
                # fails in prefill still gets a proper error status.
                first = await until_disconnect(request, stream.__anext__())
                writer = CompletionWriter(config.model_id)
                if not chat.stream:
                    body = _collect(writer, first, stream, chat.logprobs)
                    return JSONResponse(await until_disconnect(request, body))
            except (MlxvlmError, ValueError, TemplateError) as error:
                raise as_api_error(error) from error
            include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
            events = _stream_events(writer, first, stream, include_usage, chat.logprobs)

            def on_close(s: TokenStream = stream) -> None:
                s.cancel()
                service.release()

            handed_over = True
            return EventStreamResponse(events, on_close)
        finally:
            if not handed_over:
                if stream is not None:
                    stream.cancel()
                service.release()

    async def _collect(writer: CompletionWriter, first: BatchStep, stream: TokenStream,
                       want_logprobs: bool | None) -> dict:
        texts, logprobs, step = [], [], first
        while True:
            texts.append(step.text)
            if want_logprobs:
                logprobs.append(logprob_content(token_bytes, step))
            if step.finish_reason is not None:
                break
            step = await stream.__anext__()
        return writer.body("".join(texts), step, logprobs if want_logprobs else None)

    async def _stream_events(writer: CompletionWriter, first: BatchStep, stream: TokenStream,
                             include_usage: bool, want_logprobs: bool | None
                             ) -> AsyncIterator[str]:
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

    return app
