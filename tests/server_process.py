"""The server and the chat UI as users start them: ``python -m mlxvlm.server ...`` (or
``python -m mlxvlm.ui ...``) in a subprocess on a free loopback port, its log kept in a
file, stopped when the test is done. Connection-level guards and hostile clients are
tested through this, so that what the tests prove is what the entry point runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

START_TIMEOUT = 180.0  # a cold start imports torch-free transformers and loads the model


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class EntryPointProcess:
    """``python -m mlxvlm.<entry> *args --port P``; ready once ``ready_path`` answers."""

    entry = "server"
    ready_path = "/health"
    exit_wait = 20.0  # seconds for a graceful exit after Ctrl-C, then it is killed

    def __init__(self, *args: str, env: dict[str, str] | None = None, port: int | None = None):
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [*args, "--port", str(self.port)]
        self.env = {**os.environ, **(env or {})}
        self.env.pop("MLXVLM_ALLOW_TORCH", None)  # as a user's process runs: torch-free
        self._log_file = tempfile.NamedTemporaryFile(
            "w+", prefix=f"mlxvlm-{self.entry}-", suffix=".log", delete=False)
        self.process: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", f"mlxvlm.{self.entry}", *self.args]

    def log(self) -> str:
        return Path(self._log_file.name).read_text(errors="replace")

    def __enter__(self) -> "EntryPointProcess":
        self.process = subprocess.Popen(self.command, env=self.env, stdin=subprocess.DEVNULL,
                                        stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{' '.join(self.command)} exited with "
                                   f"{self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + self.ready_path, timeout=2).status_code < 500:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.__exit__(None, None, None)
        raise RuntimeError(f"{' '.join(self.command)} did not start in {START_TIMEOUT:g} s:\n"
                           f"{self.log()}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=self.exit_wait)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()

    def rss_bytes(self) -> int:
        """The server process's resident memory now (Linux's /proc)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")

    def openai_client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=f"{self.base_url}/v1", max_retries=0, timeout=120.0,
                             **kwargs)


class ServerProcess(EntryPointProcess):
    entry = "server"
    ready_path = "/health"


class UIProcess(EntryPointProcess):
    entry = "ui"
    ready_path = "/"
    # Gradio waits ~5 s for its clients' queues after Ctrl-C; no test looks at that exit.
    exit_wait = 1.0
