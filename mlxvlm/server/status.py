"""Counting every HTTP answer by status, for ``/metrics``: one ASGI middleware around all
routes, so that a status is counted however it was made (a route, an error handler, a
middleware refusing the request) and no route has to remember to."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxvlm.server.security import HTTPMiddleware
from mlxvlm.server.service import RequestCounters


class StatusCounting(HTTPMiddleware):
    def __init__(self, app: ASGIApp, counters: RequestCounters):
        super().__init__(app)
        self.counters = counters

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        status: int | None = None

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            # Escaping before any answer, it becomes the outermost handler's 500.
            if status is None:
                status = 500
            raise
        finally:
            if status is not None:
                self.counters.count(status)
