"""OpenAI-compatible HTTP server with continuous batching (``python -m mlxvlm.server``).

Needs the ``server`` extra: ``pip install "mlxvlm[server]"``.
"""

__all__ = ["create_app", "ServerConfig"]


def __getattr__(name: str):
    # Imported on first use, so that ``python -m mlxvlm.server`` (which runs this file
    # first) can still say which extra to install when FastAPI is missing.
    if name == "create_app":
        from mlxvlm.server.app import create_app

        return create_app
    if name == "ServerConfig":
        from mlxvlm.server.config import ServerConfig

        return ServerConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
