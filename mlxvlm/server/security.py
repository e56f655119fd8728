"""Access control and input bounds at the HTTP edge: the Host check (DNS rebinding), the
API keys, the JSON content type (cross-site forms), and reading the body within a size
cap, a deadline and a server-wide buffering budget.

(Media policy — no remote fetches unless allowed and then public addresses only, local
files only inside the allowed folder, byte and pixel caps — is enforced by
``mlxvlm.media`` under the policy ``GenerationService.media_policy`` gives it.
Connection-level limits — header deadline, connection cap — are in ``protocol``.)
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import threading
from typing import Iterable

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxvlm.server.errors import APIError, ClientDisconnected, error_response

# Paths anyone may call: a liveness probe must not need the key.
PUBLIC_PATHS = frozenset({"/health"})
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Where the matching key's id is left for the handlers (prefix-cache namespacing).
KEY_ID = "mlxvlm_api_key_id"


def is_loopback_bind(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_host_names(bind_host: str, extra: Iterable[str]) -> frozenset[str] | None:
    """The Host names a server bound to ``bind_host`` answers, lower case and without
    port; None: any. A loopback-bound server answers only loopback names (a web page
    that rebinds its own name to 127.0.0.1 then still cannot talk to it), unless
    ``extra`` widens that; a server bound elsewhere is meant to be reached under names
    it cannot know, so it answers any unless ``extra`` is given."""
    names = {name.strip().lower().strip("[]") for name in extra if name.strip()}
    if "*" in names:
        return None
    if not names and not is_loopback_bind(bind_host):
        return None
    return frozenset(names | set(LOOPBACK_HOSTS))


def host_name(header: str) -> str:
    """``Host`` without its port, lower case; an IPv6 literal without brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HTTPMiddleware:
    """An ASGI middleware that acts on HTTP requests (``handle``); other connections pass
    through untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class HostCheckMiddleware(HTTPMiddleware):
    """Answers 421 to a request whose ``Host`` is not one of ``allowed``."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]):
        super().__init__(app)
        self.allowed = allowed

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_name(given) in self.allowed:
            await self.app(scope, receive, send)
            return
        shown = given[:100] or "(none)"
        response = error_response(APIError(
            421, f"this server does not answer to the host {shown!r}; it answers "
            f"{', '.join(sorted(self.allowed))} (the server's --allowed-hosts)",
            code="invalid_host"), scope["path"])
        await response(scope, receive, send)


def key_id(key: str) -> str:
    """A short, stable name for an API key that does not reveal it."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class APIKeyMiddleware(HTTPMiddleware):
    """Requires one of ``api_keys`` on every path but ``PUBLIC_PATHS`` (and CORS
    preflights, which browsers send without credentials): as ``Authorization: Bearer
    <key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's). The matching key's
    ``key_id`` goes into the request's state as ``KEY_ID``."""

    def __init__(self, app: ASGIApp, api_keys: Iterable[str]):
        super().__init__(app)
        self.expected = [(key.encode(), key_id(key)) for key in api_keys]

    def _match(self, given: bytes) -> str | None:
        found = None
        for expected, name in self.expected:  # every key compared: no timing hint
            if hmac.compare_digest(given, expected):
                found = name
        return found

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"")
        x_api_key = headers.get(b"x-api-key", b"")
        name = None
        if authorization.startswith(b"Bearer "):
            name = self._match(authorization[len(b"Bearer "):])
        if name is None and x_api_key:
            name = self._match(x_api_key)
        if name is not None:
            scope.setdefault("state", {})[KEY_ID] = name
            await self.app(scope, receive, send)
            return
        message = (
            "incorrect API key provided" if authorization or x_api_key else
            "missing API key; send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        )
        response = error_response(
            APIError(401, message, code="invalid_api_key",
                     headers={"WWW-Authenticate": 'Bearer realm="mlxvlm"'}),
            scope["path"],
        )
        await response(scope, receive, send)


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON. A browser page on another site can send a
    form or ``text/plain`` body without asking, but not ``application/json``: that needs
    a CORS preflight, which this server only grants to ``--allowed-origins``."""
    given = request.headers.get("content-type", "")
    if given.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(
            415, f"the request body must be JSON, sent with 'Content-Type: application/json'"
            f" (got {given[:100]!r})" if given else
            "the request body must be JSON, sent with 'Content-Type: application/json'",
            code="unsupported_media_type")


class BodyBudget:
    """The bytes of request bodies being read, across all requests: a cap on what slow
    or stalled uploads can make the server hold."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.in_use = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.in_use + n > self.max_bytes:
                return False
            self.in_use += n
            return True

    def give_back(self, n: int) -> None:
        with self._lock:
            self.in_use -= n


async def read_body(request: Request, max_bytes: int, *, timeout: float | None = None,
                    budget: BodyBudget | None = None) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``max_bytes``
    (from Content-Length before reading, or while reading a chunked body), with 408 if
    it has not all arrived within ``timeout`` seconds, and with 503 while the bodies
    being read by all requests would pass ``budget``. A client that goes away while
    sending raises ``ClientDisconnected``."""
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
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                if budget is not None and not budget.take(len(chunk)):
                    raise APIError(
                        503, f"the server is already holding {budget.in_use} bytes of request "
                        f"bodies, its limit is {budget.max_bytes}; retry in a moment",
                        code="server_busy", headers={"Retry-After": "1"})
                size += len(chunk)
                chunks.append(chunk)
                if size > max_bytes:
                    raise too_large
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} seconds "
                       "(the server's --body-timeout)", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise ClientDisconnected from None
    finally:
        if budget is not None:
            budget.give_back(size)
    return b"".join(chunks)
