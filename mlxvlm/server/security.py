"""Access control and input bounds at the HTTP edge: the API key and the body size cap.

(Media policy — no remote fetches unless allowed and then public addresses only, local
files only inside the allowed folder, byte and pixel caps — is enforced by
``mlxvlm.media`` with the options ``GenerationService.media_options`` gives it.)
"""

from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxvlm.server.errors import APIError, error_response

# Paths anyone may call: a liveness probe must not need the key.
PUBLIC_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every path but ``PUBLIC_PATHS``
    (and CORS preflights, which browsers send without credentials)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        message = (
            "incorrect API key provided" if given else
            "missing API key; send it as 'Authorization: Bearer <key>'"
        )
        response = error_response(
            APIError(401, message, code="invalid_api_key",
                     headers={"WWW-Authenticate": 'Bearer realm="mlxvlm"'})
        )
        await response(scope, receive, send)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``max_bytes``
    (from Content-Length before reading, or while reading a chunked body)."""
    too_large = APIError(
        413,
        f"the request body is larger than the limit of {max_bytes} bytes; send smaller or "
        "fewer images (the server's --max-body-bytes)",
        code="request_too_large",
    )
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, "invalid Content-Length header")
        if int(length) > max_bytes:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)
