"""A live mlxvlm server for tests: the entry point's guarded uvicorn server on 127.0.0.1
and a free port, in a thread of the test process (so tests can also look at the engine),
shut down when the test is done. What users start, ``python -m mlxvlm.server``, is tested
through ``server_process.ServerProcess``."""

from __future__ import annotations

import base64
import io
import socket
import struct
import threading
import time
import zlib

import openai

from mlxvlm.mlx_threads import clear_streams_when_thread_ends
from mlxvlm.server import ServerConfig, create_app
from mlxvlm.server.app import create_registry_app
from mlxvlm.server.listener import guarded_server

MODEL_ID = "tiny-qwen2-vl"
START_TIMEOUT = 30.0


def wait_until(condition, timeout: float = 20.0, interval: float = 0.01) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes (a bounded wait for a state
    change in another thread, never a fixed sleep standing in for synchronisation)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


class LiveServer:
    def __init__(self, model, processor, *, registry=None, **config):
        """One loaded model, or (``registry``) the models of a ``ModelRegistry``."""
        if registry is not None:
            self.config = registry.config
            self.app = create_registry_app(registry)
        else:
            config.setdefault("model_id", MODEL_ID)
            self.config = ServerConfig(**config)
            self.app = create_app(model, processor, self.config)
        self.models = self.app.state.models
        self.service = self.models.service(self.config.model_id) \
            if self.config.model_id in self.models.loaded_ids() else None
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        # The entry point's own server (listener.guarded_server), here in a thread.
        self._server = guarded_server(self.app, self.config, log_level="warning",
                                      timeout_graceful_shutdown=2)
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        # This thread is the event loop's: the routes may run MLX on it.
        clear_streams_when_thread_ends()
        self._server.run(sockets=[self._socket])

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        if not wait_until(lambda: self._server.started, START_TIMEOUT):
            raise RuntimeError("the test server did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._socket.close()

    @property
    def engine(self):
        return self.service.engine

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.config.api_key or "unused")
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", max_retries=0, timeout=60.0, **kwargs
        )


def png_data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def bomb_png(width: int = 40_000, height: int = 40_000) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` pixels (a decompression bomb:
    decoding it would need width*height bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    rows = zlib.compress(b"\0" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def user(text: str, *images_as_urls: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in images_as_urls]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}
