"""How the server starts listening and serving, for every way it is started: the entry
point (``python -m mlxvlm.server``, one process or rank 0 under mlx.launch) and the tests
alike, so that the connection guards of ``protocol`` are what users run.

The listening socket is opened before the model loads: a port already in use is one line
naming ``--port`` at once, not an error after a load that can take minutes, and nothing
else can take the port while the model loads.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from mlxvlm.errors import MlxvlmError


def open_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (an IPv6 address where ``host`` has a
    colon, as uvicorn binds), or a one-line ``MlxvlmError`` saying which flag to change."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn does: a restarted server may take the port while old connections of
        # the previous one are in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except socket.gaierror:
        sock.close()
        raise MlxvlmError(f"--host {host!r} is not an address or host name this machine "
                          "can listen on (e.g. 127.0.0.1, or 0.0.0.0 for every address)")
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise MlxvlmError(f"port {port} on {host} is already in use: pass --port with "
                              "another port (or stop what is using it)") from None
        if exc.errno == errno.EACCES:
            raise MlxvlmError(f"not allowed to listen on port {port} (ports below 1024 need "
                              "administrator rights): pass --port 1024 or higher") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise MlxvlmError(f"--host {host} is not an address of this machine") from None
        raise MlxvlmError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def guarded_server(app: Any, config: Any, **kwargs: Any):
    """The ``uvicorn.Server`` that serves ``app`` under ``config``'s (a ``ServerConfig``)
    connection guards (``protocol.uvicorn_config``); run it with the socket of
    ``open_listener``."""
    import uvicorn

    from mlxvlm.server.protocol import uvicorn_config

    kwargs.setdefault("timeout_graceful_shutdown", 5)
    return uvicorn.Server(uvicorn_config(app, config, **kwargs))


def serve(app: Any, config: Any, listener: socket.socket, *, log_level: str = "info") -> None:
    """Serve ``app`` on ``listener`` until interrupted."""
    guarded_server(app, config, log_level=log_level).run(sockets=[listener])
