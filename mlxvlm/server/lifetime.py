"""One chat request's lifetime, owned by one object: its admission slot, the waits that a
client's disconnect cancels, its token stream, and the release of all of it exactly once
-- when the answer is complete, when it fails, or when the client goes away, before or
while streaming."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import StreamingResponse

from mlxvlm.generate.speech import SpeechRequest
from mlxvlm.sampling import SamplingOptions
from mlxvlm.server.errors import APIError, ClientDisconnected
from mlxvlm.server.service import GenerationService, PreparedRequest, TokenStream


class RequestLifetime:
    """Use as ``with RequestLifetime(service, request) as life:``. Entering takes an
    admission slot (429 when there is none); leaving gives it back and cancels the
    stream, unless ``event_stream`` handed the request to its response, which then does
    so when the stream ends."""

    def __init__(self, service: GenerationService, request: Request):
        self.service = service
        self.request = request
        self.stream: TokenStream | None = None
        self._released = False
        self._handed_to_response = False

    def __enter__(self) -> "RequestLifetime":
        service = self.service
        if not service.try_admit():
            raise APIError(
                429,
                f"the server is busy ({service.in_flight} requests in flight, at most "
                f"{service.capacity}); retry after a moment",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(service.config.retry_after_seconds)},
            )
        return self

    def __exit__(self, *_: Any) -> None:
        if not self._handed_to_response:
            self.release()

    def release(self) -> None:
        """Stop the stream in the engine and give the slot back; only the first call
        does anything."""
        if self._released:
            return
        self._released = True
        if self.stream is not None:
            self.stream.cancel()
        self.service.release()

    def submit(self, prepared: PreparedRequest, options: SamplingOptions,
               speech: SpeechRequest | None = None) -> TokenStream:
        self.stream = self.service.submit(prepared, options, speech)
        return self.stream

    async def until_disconnect(self, work: Awaitable) -> Any:
        """``await work``, unless the client disconnects first: then cancel it and raise
        ``ClientDisconnected``."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(self._wait_for_disconnect())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task.done():
            return task.result()
        task.cancel()
        raise ClientDisconnected

    async def _wait_for_disconnect(self) -> None:
        await client_gone(self.request)

    def event_stream(self, events: AsyncIterator[str]) -> StreamingResponse:
        """The response that streams ``events`` and, however it ends, releases this
        request."""
        self._handed_to_response = True
        return _EventStreamResponse(events, self)

    def byte_stream(self, content: AsyncIterator[bytes], media_type: str) -> StreamingResponse:
        """The response that streams ``content`` (chunked) and, however it ends, releases
        this request."""
        self._handed_to_response = True
        return _EventStreamResponse(content, self, media_type=media_type, headers={})


async def client_gone(request: Request) -> None:
    """Returns once the client of ``request``, whose body has been read, goes away (the
    next ASGI message is then the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStreamResponse(StreamingResponse):
    """Server-sent events that release their request however the stream ends: finished,
    failed, or abandoned by the client (before or while streaming)."""

    def __init__(self, content: AsyncIterator, lifetime: RequestLifetime,
                 media_type: str = "text/event-stream", headers: dict | None = None):
        super().__init__(
            content,
            media_type=media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            if headers is None else headers,
        )
        self._lifetime = lifetime

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._lifetime.release()
            await self.body_iterator.aclose()
