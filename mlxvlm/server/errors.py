"""Errors in the shape of the API a path belongs to: OpenAI's ``{"error": {"message",
"type", "param", "code"}}``, or Anthropic's ``{"type": "error", "error": {"type",
"message"}}`` under ``/v1/messages``.

Every error a client can see goes through here, including FastAPI's and Starlette's own
(validation, unknown route, wrong method), so that no other body shape ever reaches a
client; 5xx is kept for real server faults.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

logger = logging.getLogger("mlxvlm.server")

# OpenAI's error types by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


# Anthropic's error types by status (its API's own names).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}

# Paths whose clients expect Anthropic's error shape.
ANTHROPIC_PATH = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


# Status recorded for a request whose client went away (nginx's convention).
CLIENT_CLOSED = 499


class ClientDisconnected(Exception):
    """The client went away before its answer was ready (counted as 499, not an error)."""


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self, path: str = "") -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code,
                          path=path)


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None, path: str = "") -> dict[str, Any]:
    """The error body a client of ``path`` expects."""
    if is_anthropic_path(path):
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else
                                    "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError, path: str = "") -> JSONResponse:
    return JSONResponse(error.body(path), status_code=error.status, headers=error.headers)


def validation_error(errors: list[dict]) -> APIError:
    """The one formatter of invalid input (a chat body pydantic refused, or a parameter
    FastAPI did): the most specific problem. For a value that may take several shapes (a
    string or a list of parts) the error deepest inside it says what is wrong."""
    if not errors:
        return APIError(400, "invalid request")
    first = max(errors, key=lambda e: len(e["loc"]))
    # Drop FastAPI's "body" and pydantic's union-branch labels ("str", "list[...]", tag
    # names) from the path.
    path = [str(p) for p in first["loc"] if isinstance(p, int) or p.isidentifier()]
    path = [p for p in path if p not in ("body", "str", "list", "dict")]
    param = ".".join(path) or None
    message = first["msg"]
    # A validator's own ValueError reaches us as "Value error, <its message>".
    message = message.removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def not_found_message(request: Request) -> str:
    """A 404's message; where the path exists under ``/v1`` (a client whose base URL
    lacks it, such as ``OpenAI(base_url="http://127.0.0.1:8080")``), say so."""
    path = request.url.path
    if not path.startswith("/v1/"):
        under_v1 = "/v1" + (path if path.startswith("/") else "/" + path)
        scope = {**request.scope, "path": under_v1, "path_params": {}}
        # Any match counts: a PARTIAL one is the right path with another method.
        if any(route.matches(scope)[0] is not Match.NONE for route in request.app.routes):
            base = str(request.base_url).rstrip("/")
            return (f"no route {path}: the API is under /v1, at {under_v1} (OpenAI clients "
                    f"take base_url={base}/v1; Anthropic's take {base})")
    return f"no route {path} (the API is under /v1: /v1/chat/completions, /v1/responses, " \
           "/v1/messages, /v1/models)"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(error, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        return error_response(validation_error(list(error.errors())), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        status = error.status_code
        message = error.detail if isinstance(error.detail, str) else "request failed"
        code = "not_found" if status == 404 else None
        if status == 404 and error.detail == "Not Found":  # no route, not a route's own 404
            message = not_found_message(request)
        return error_response(APIError(status, message, code=code, headers=error.headers),
                              request.url.path)

    @app.exception_handler(ClientDisconnect)
    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, _: Exception):
        # Nobody is left to read an answer; the status is for the log and /metrics.
        logger.info("client went away during %s %s", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def server_fault(request: Request, error: Exception):
        logger.exception("unhandled error")
        return error_response(APIError(500, "internal server error; see the server log"),
                              request.url.path)
