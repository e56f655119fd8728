"""Raw HTTP over a socket, for tests of what a server does with clients that are slow,
stop half-way or do not speak HTTP properly (an HTTP client library would not send
those bytes)."""

from __future__ import annotations

import json
import socket

CHAT_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
             b"Content-Type: application/json\r\n")


def raw_socket(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    if data:
        sock.sendall(data)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP response that ends with the connection (error answers all say
    Connection: close)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), data[:200]
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def assert_raw_error(raw: tuple[int, dict, bytes], status: int, code: str | None = None) -> dict:
    """An OpenAI-shaped JSON error with ``status`` (and ``code``)."""
    got, headers, body = raw
    assert got == status, raw
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error
