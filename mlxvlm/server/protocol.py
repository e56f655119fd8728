"""Connection-level limits that uvicorn does not have, as a subclass of its h11 protocol:

- a cap on open connections, enforced when a connection is accepted (uvicorn's
  ``limit_concurrency`` only answers once a request's headers have arrived, so stalled
  clients would still hold their sockets); a connection beyond it is answered 503 and
  closed at once;
- a deadline for each request's headers, from the connection's start or the previous
  answer (uvicorn's keep-alive timer stops at the first byte, so a client sending one
  header byte at a time was held forever); late ones get 408 and are closed;
- a backstop deadline for a body that nobody reads (the app's own ``read_body`` answers
  408 for the bodies it reads; this one closes a connection still sending after that);
- protocol errors (bad Content-Length, bad chunking, oversized headers) answered in
  OpenAI's error shape instead of plain text;
- and these events logged at most once per interval, with a count, not once each.

Bodies are never buffered beyond uvicorn's flow control (reading pauses above 64 KiB
until the app asks for more) and the app's own caps.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxvlm.server.errors import error_body

logger = logging.getLogger("mlxvlm.server")

# File descriptors left for everything but client connections (model files, the
# listening socket, media fetches, logs).
FD_RESERVE = 128


class RateLimitedLog:
    """Logs each kind of event at most once per ``interval`` seconds, saying how many
    were not logged since."""

    def __init__(self, interval: float = 10.0, log: logging.Logger = logger):
        self.interval = interval
        self.log = log
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        missed = self._suppressed.pop(kind, 0)
        if missed:
            message += f" (and {missed} more like it in the last {self.interval:g} s)"
        self.log.warning(message, *args)


class RateLimitFilter(logging.Filter):
    """A ``logging`` filter that lets a record whose message starts with one of
    ``prefixes`` through at most once per ``interval`` seconds (for uvicorn's and
    asyncio's own per-event warnings)."""

    def __init__(self, prefixes: tuple[str, ...], interval: float = 10.0):
        super().__init__()
        self.prefixes = prefixes
        self.interval = interval
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        for prefix in self.prefixes:
            if message.startswith(prefix):
                now = time.monotonic()
                if now - self._last.get(prefix, -self.interval) < self.interval:
                    return False
                self._last[prefix] = now
        return True


_NOISY = {
    "uvicorn.error": ("Invalid HTTP request received.", "Exceeded concurrency limit."),
    "asyncio": ("socket.accept() out of system resource",),
}


def install_log_filters(interval: float = 10.0) -> None:
    for name, prefixes in _NOISY.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in target.filters):
            target.addFilter(RateLimitFilter(prefixes, interval))


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (where the system
    allows), and return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # macOS reports an unlimited hard limit but refuses more than its per-process maximum.
    for target in ((hard if hard != resource.RLIM_INFINITY else 1 << 16), 10240):
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            continue
    return soft


def connection_cap(requested: int, fd_limit: int) -> int:
    """``requested``, lowered to leave ``FD_RESERVE`` descriptors under ``fd_limit``."""
    return max(1, min(requested, fd_limit - FD_RESERVE))


def raw_response(status: int, reason: str, message: str, code: str,
                 headers: dict[str, str] | None = None) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection, for answers written
    before (or without) a parsed request."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
             f"content-length: {len(body)}", "connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class ConnectionLimits:
    max_connections: int
    header_timeout: float
    body_timeout: float
    log: RateLimitedLog = field(default_factory=RateLimitedLog)
    refused: int = 0  # connections refused at the cap, for /metrics
    timed_out: int = 0  # connections closed for slow headers or bodies
    # uvicorn's set of this server's open connections, once one has been made.
    server_connections: set = field(default_factory=set)

    @property
    def open(self) -> int:
        return len(self.server_connections)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits in ``limits`` (see the module docstring);
    ``protocol_class`` makes the subclass uvicorn instantiates."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._refused = False
        self._header_timer = None
        self._body_timer = None

    # -- the connection cap -------------------------------------------------------

    def connection_made(self, transport) -> None:  # type: ignore[override]
        limits = self.limits
        limits.server_connections = self.connections
        if len(self.connections) >= limits.max_connections:
            self._refused = True
            limits.refused += 1
            transport.write(raw_response(
                503, "Service Unavailable",
                f"the server has {len(self.connections)} open connections, its limit is "
                f"{limits.max_connections} (the server's --max-connections); retry in a moment",
                "server_busy", {"retry-after": "1"}))
            transport.close()
            limits.log.warning("connections", "refusing connections: %d open, the limit is %d",
                               len(self.connections), limits.max_connections)
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.conn.their_state is h11.IDLE and self._headers_too_large(data):
            return
        super().data_received(data)
        self._follow_state()

    def _headers_too_large(self, data: bytes) -> bool:
        """h11 bounds only headers that arrive in pieces; a header block that arrives in
        one read of any size is parsed whole. Bound it here, whichever way it comes."""
        limit = self.conn._max_incomplete_event_size
        pending = self.conn.trailing_data[0]
        if len(pending) + len(data) <= limit:
            return False
        head = (pending + data)[: limit + 4]
        if b"\r\n\r\n" in head or b"\n\n" in head:
            return False
        self.limits.log.warning("header-size", "refused a request whose headers pass %d bytes",
                                limit)
        self.transport.write(raw_response(
            431, "Request Header Fields Too Large",
            f"the request headers are larger than {limit} bytes", "headers_too_large"))
        self.transport.close()
        return True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_state()

    # -- deadlines ------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout,
                                                      self._headers_too_slow)

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None

    def _follow_state(self) -> None:
        """Run the header deadline while the client owes us a request's headers, and the
        body deadline while it owes us its body."""
        if self.transport.is_closing():
            self._cancel_timers()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            self._arm_header_timer()
        elif self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if state is h11.SEND_BODY:
            if self._body_timer is None:
                # A little after the app's own deadline, so that it answers first.
                self._body_timer = self.loop.call_later(self.limits.body_timeout + 1.0,
                                                        self._body_too_slow)
        elif self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial = bool(self.conn.trailing_data[0])
        if partial or self.cycle is None:
            # A connection that never sent a request, or stopped inside one.
            self.limits.timed_out += 1
            self.limits.log.warning(
                "headers", "closed a connection whose request headers did not arrive within "
                "%g s", self.limits.header_timeout)
            self.transport.write(raw_response(
                408, "Request Timeout", f"the request headers did not arrive within "
                f"{self.limits.header_timeout:g} seconds", "request_timeout"))
        self.transport.close()

    def _body_too_slow(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        self.limits.timed_out += 1
        self.limits.log.warning("body", "closed a connection whose request body did not "
                                "arrive within %g s", self.limits.body_timeout)
        self.transport.close()

    # -- protocol errors ------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, in OpenAI's shape."""
        detail = "the request is not valid HTTP/1.1 (check Content-Length, " \
                 "Transfer-Encoding and the header syntax; headers must fit in " \
                 f"{self.conn._max_incomplete_event_size} bytes)"
        body = json.dumps(error_body(400, detail, code="invalid_http")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                             reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            # A response had already begun (an error in the middle of a body): nothing
            # more can be said on this connection.
            pass
        self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    return type("MlxvlmH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def uvicorn_config(app: Any, config: Any, **kwargs: Any):
    """The ``uvicorn.Config`` that serves ``app`` with ``config``'s (a ``ServerConfig``)
    connection limits: raises the open-file limit, caps connections below it, installs
    the rate-limited log filters, and leaves the limits in ``app.state.connection_limits``
    (for /metrics)."""
    import uvicorn

    fd_limit = raise_open_file_limit()
    cap = connection_cap(config.max_connections, fd_limit)
    if cap < config.max_connections:
        logger.warning("serving at most %d connections (not %d): the open-file limit is %d",
                       cap, config.max_connections, fd_limit)
    limits = ConnectionLimits(cap, config.header_timeout, config.body_timeout)
    install_log_filters()
    app.state.connection_limits = limits
    kwargs.setdefault("host", config.host)
    kwargs.setdefault("port", config.port)
    return uvicorn.Config(app, http=protocol_class(limits), **kwargs)
