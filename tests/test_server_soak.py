"""A soak of hostile clients against a real uvicorn server on 127.0.0.1 with small limits:
connections that never finish their headers or their bodies, a flood of requests full of
huge (but tiny-to-send) images, clients that vanish mid-request, and more connections
than the cap, while a well-behaved client keeps getting the right answer and the
process's memory stays bounded.

Every loop is bounded in count; every wait polls up to a generous deadline.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from PIL import Image
from server_harness import MODEL_ID, LiveServer, png_data_url, user, wait_until
from tiny import make_image

import mlxvlm

LIMITS = dict(header_timeout=1.0, body_timeout=1.5, max_connections=96,
              max_body_bytes=4 * 2**20, max_request_pixels=30_000_000,
              max_total_pixels=30_000_000)
HEADER_STALLS, BODY_STALLS, FLOODS, VANISHING = 24, 12, 6, 30
FLOOD_IMAGES = 20  # 5000x5000 each: 500M decoded pixels per request, unbudgeted
RSS_GROWTH_LIMIT = 1024 * 2**20  # unbudgeted, the flood needs several GB
DEADLINE = 30.0


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


class PeakRSS:
    """The peak resident size from now on: the kernel's high-water mark where it can be
    reset, else sampled."""

    def __init__(self):
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM
            self.hwm = True
        except OSError:
            self.hwm = False
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_bytes("VmHWM") if self.hwm else 0)


class CountingHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)


def read_status(sock: socket.socket) -> int | str:
    """The status of the response on ``sock`` (read to the end), else why there was none
    ("reset", "timeout" or "closed")."""
    data, ended = b"", "closed"
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        ended = "reset"
    except socket.timeout:
        ended = "timeout"
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else ended


CHAT_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
             b"Content-Type: application/json\r\n")


def solid_png(size: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 60)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))


def test_soak(loaded):
    flood_url = "data:image/png;base64," + base64.b64encode(solid_png(5000)).decode()
    flood_body = json.dumps({
        "model": MODEL_ID, "max_tokens": 2, "temperature": 0,
        "messages": [user("Describe.", *[flood_url] * FLOOD_IMAGES)]}).encode()
    good = {"model": MODEL_ID, "max_tokens": 6, "temperature": 0,
            "messages": [user("What is this?", png_data_url(make_image(40, 40, 5)))]}
    logs = CountingHandler()
    logging.getLogger().addHandler(logs)
    with LiveServer(*loaded, **LIMITS) as server:
        url = f"{server.base_url}/v1/chat/completions"
        expected = httpx.post(url, json=good, timeout=60).json()["choices"][0]["message"]
        baseline = rss_bytes()
        peak = PeakRSS()

        answers, wrong, stop = [], [], threading.Event()

        def well_behaved():
            with httpx.Client(timeout=60) as client:
                for _ in range(500):
                    if stop.is_set():
                        return
                    response = client.post(url, json=good)
                    if response.status_code != 200 or \
                            response.json()["choices"][0]["message"] != expected:
                        wrong.append(response.text)
                    answers.append(response.status_code)

        normal = threading.Thread(target=well_behaved)
        normal.start()

        # Stalled clients: headers that never end, bodies that never end.
        header_stalls = [connect(server.port) for _ in range(HEADER_STALLS)]
        for sock in header_stalls:
            sock.sendall(CHAT_HEAD)
        body_stalls = [connect(server.port) for _ in range(BODY_STALLS)]
        for sock in body_stalls:
            sock.sendall(CHAT_HEAD + b"Content-Length: 100000\r\n\r\n{\"model\": \"")

        # The pixel flood, a few at once.
        flood_statuses: list[int] = []

        def flood():
            response = httpx.post(url, content=flood_body, timeout=60,
                                  headers={"Content-Type": "application/json"})
            flood_statuses.append(response.status_code)
            assert response.json()["error"]["code"] in ("too_many_pixels",
                                                        "rate_limit_exceeded")

        flooders = [threading.Thread(target=flood) for _ in range(FLOODS)]
        for thread in flooders:
            thread.start()

        # Clients that vanish: after the whole request, or in the middle of the body.
        request_bytes = json.dumps(good).encode()
        for i in range(VANISHING):
            with connect(server.port) as sock:
                whole = CHAT_HEAD + f"Content-Length: {len(request_bytes)}\r\n\r\n".encode()
                sock.sendall(whole + (request_bytes if i % 2 else request_bytes[:50]))

        # Every stalled client is answered 408 and let go.
        statuses = [read_status(sock) for sock in header_stalls + body_stalls]
        for sock in header_stalls + body_stalls:
            sock.close()
        assert statuses == [408] * (HEADER_STALLS + BODY_STALLS), \
            [(i, status) for i, status in enumerate(statuses) if status != 408]
        for thread in flooders:
            thread.join(timeout=DEADLINE)
        assert len(flood_statuses) == FLOODS and set(flood_statuses) <= {400, 429}
        assert wait_until(lambda: len(answers) >= 5, DEADLINE)
        stop.set()
        normal.join(timeout=DEADLINE)
        growth = peak.stop() - baseline
        assert not wrong, wrong[:3]
        print(f"peak RSS growth under the soak: {growth / 2**20:.0f} MiB")
        assert growth < RSS_GROWTH_LIMIT, f"peak RSS grew by {growth / 2**20:.0f} MiB"

        # Vanished clients are 499s, never 500s; nothing is left in flight.
        assert wait_until(lambda: server.service.in_flight == 0, DEADLINE)
        by_status = server.service.counters.by_status
        assert 500 not in by_status, by_status
        assert by_status.get(499, 0) >= VANISHING // 2

        # More connections than the cap: the excess is refused at once, and once the
        # header deadline frees the rest, the server answers again.
        cap = LIMITS["max_connections"]
        crowd = [connect(server.port) for _ in range(cap + 20)]
        try:
            refused = sum(read_status(sock) == 503 for sock in crowd[cap:])
            assert refused >= 15  # (a few may still find a slot being freed)
        finally:
            for sock in crowd:
                sock.close()
        assert wait_until(lambda: httpx.get(f"{server.base_url}/health").status_code == 200,
                          DEADLINE)
        final = httpx.post(url, json=good, timeout=60)
        assert final.json()["choices"][0]["message"] == expected
    logging.getLogger().removeHandler(logs)
    # Each kind of event is logged a few times at most, not once per connection.
    warnings = [r for r in logs.records if r.levelno >= logging.WARNING]
    assert len(warnings) < 20, [r.getMessage() for r in warnings[:20]]
    assert not [r for r in logs.records if r.levelno >= logging.ERROR]
