"""How the server starts listening and serving, for every way it is started: the entry
point (``python -m mlxvlm.server``, one process or rank 0 under mlx.launch) and the tests
alike, so that the connection guards of ``protocol`` are what users run.

The listening socket is opened before the model loads (``cli.open_listener``): a port
already in use is one line naming ``--port`` at once, not an error after a load that can
take minutes, and nothing else can take the port while the model loads.
"""

from __future__ import annotations

import socket
from typing import Any, Callable

import uvicorn


class SignalledServer(uvicorn.Server):
    """uvicorn's server, which also tells ``on_signal(signum)`` of each SIGTERM or SIGINT
    (before uvicorn starts stopping on it): a sharded rank 0 must not wait on its engine
    forever (``sharded_stop``)."""

    on_signal: Callable[[int], None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.on_signal is not None:
            self.on_signal(sig)
        super().handle_exit(sig, frame)


def guarded_server(app: Any, config: Any, **kwargs: Any) -> SignalledServer:
    """The ``uvicorn.Server`` that serves ``app`` under ``config``'s (a ``ServerConfig``)
    connection guards (``protocol.uvicorn_config``); run it with the socket of
    ``cli.open_listener``."""
    from mlxvlm.server.protocol import uvicorn_config

    kwargs.setdefault("timeout_graceful_shutdown", 5)
    return SignalledServer(uvicorn_config(app, config, **kwargs))


def serve(app: Any, config: Any, listener: socket.socket, *, log_level: str = "info") -> None:
    """Serve ``app`` on ``listener`` until interrupted."""
    guarded_server(app, config, log_level=log_level).run(sockets=[listener])
