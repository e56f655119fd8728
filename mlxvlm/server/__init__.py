"""OpenAI-compatible HTTP server with continuous batching (``python -m mlxvlm.server``).

Needs the ``server`` extra: ``pip install "mlxvlm[server]"``.
"""

from mlxvlm.server.app import create_app
from mlxvlm.server.config import ServerConfig

__all__ = ["create_app", "ServerConfig"]
