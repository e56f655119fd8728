"""The guards of ``python -m mlxvlm.server`` as users start it (a subprocess on a free
loopback port, flags on its command line): slow or stalled clients, the connection cap,
the body buffer budget, the pixel budget, requests that are not valid HTTP, API keys,
the Host and CORS checks, a port in use, and clients whose base URL lacks ``/v1``.
(Bad JSON bodies and media are in tests/test_server_bad_input.py, in-process.)

Every wait is bounded; nothing here depends on how fast the machine is beyond the
generous deadlines.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest
from raw_http import CHAT_HEAD, assert_raw_error, raw_socket, read_response
from server_harness import bomb_png, png_data_url, user, wait_until
from server_process import ServerProcess
from tiny import make_image
from user_environment import user_environment

MODEL_ID = "tiny"
GUARDS = dict(header_timeout=1.0, body_timeout=1.0, max_connections=8, max_body_bytes=150_000,
              max_buffered_body_bytes=200_000, max_request_pixels=10_000,
              max_total_pixels=40_000)


def flags(**values) -> list[str]:
    return [part for name, value in values.items()
            for part in (f"--{name.replace('_', '-')}", str(value))]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return str(tiny_checkpoints.path("qwen2_vl", "hub"))


@pytest.fixture(scope="module")
def guarded(checkpoint):
    with ServerProcess("--model", checkpoint, "--served-model-name", MODEL_ID,
                       *flags(**GUARDS)) as server:
        yield server


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def open_connections(server) -> int:
    """Open connections besides the one asking."""
    return int(metric(server, "mlxvlm_connections_open")) - 1


def post(server, body, path: str = "/v1/chat/completions", **kwargs) -> httpx.Response:
    content = json.dumps(body) if isinstance(body, (dict, list)) else body
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=60,
                      **kwargs)


def request(content, **fields) -> dict:
    messages = [content] if isinstance(content, dict) else [{"role": "user", "content": content}]
    return {"model": MODEL_ID, "messages": messages, "max_tokens": 4, "temperature": 0, **fields}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_serving(server) -> None:
    response = post(server, request("hi"))
    assert response.status_code == 200, response.text


HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def health_answer(sock: socket.socket) -> bytes:
    """The whole answer to ``HEALTH`` on a kept-alive connection (its JSON body ends in
    a brace), or what came before the server closed it."""
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


# -- slow clients --------------------------------------------------------------------------

def test_headers_that_never_finish_get_408(guarded):
    before = metric(guarded, "mlxvlm_connections_timed_out_total")
    with raw_socket(guarded.port, CHAT_HEAD) as sock:  # no blank line: headers never end
        assert_raw_error(read_response(sock), 408, code="request_timeout")
    assert metric(guarded, "mlxvlm_connections_timed_out_total") == before + 1
    assert_serving(guarded)


def test_many_stalled_connections_are_all_closed_at_the_header_deadline(guarded):
    """What a slowloris does: every connection stops in the middle of its headers; the
    server closes each one at --header-timeout (1 s here), none is held for longer than a
    generous bound."""
    assert wait_until(lambda: open_connections(guarded) == 0)
    stalled = [raw_socket(guarded.port, CHAT_HEAD[:20 + i]) for i in range(6)]
    try:
        for sock in stalled:
            sock.settimeout(15)  # 15 x the deadline
            assert_raw_error(read_response(sock), 408, code="request_timeout")
    finally:
        for sock in stalled:
            sock.close()
    assert_serving(guarded)


def test_headers_trickled_on_a_kept_alive_connection_get_408(guarded):
    with raw_socket(guarded.port, HEALTH) as sock:
        assert health_answer(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /hea")  # the next request starts, and stops
        assert_raw_error(read_response(sock), 408, code="request_timeout")
    assert_serving(guarded)


def test_a_body_that_never_finishes_gets_408(guarded):
    with raw_socket(guarded.port, CHAT_HEAD + b"Content-Length: 500\r\n\r\n{\"model\":") as sock:
        error = assert_raw_error(read_response(sock), 408, code="request_timeout")
        assert "body" in error["message"]
    assert_serving(guarded)


def test_disconnect_in_the_middle_of_the_body_is_499(guarded):
    label = '{status="499"}'
    before = metric(guarded, "mlxvlm_requests_total", label)
    with raw_socket(guarded.port, CHAT_HEAD + b"Content-Length: 900\r\n\r\n{\"model\": "):
        assert wait_until(lambda: open_connections(guarded) >= 1)
    assert wait_until(lambda: metric(guarded, "mlxvlm_requests_total", label) == before + 1)
    assert metric(guarded, "mlxvlm_requests_total", '{status="500"}') == 0
    assert "Traceback" not in guarded.log()
    assert_serving(guarded)


# -- the connection cap and the body buffer budget -------------------------------------

def held_connection(port: int, tries: int = 20) -> socket.socket:
    """A kept-alive connection the server has accepted and answered once (a connection
    refused at the cap, while the server was still closing an earlier one, is retried)."""
    for _ in range(tries):
        sock = raw_socket(port, HEALTH)
        if health_answer(sock).startswith(b"HTTP/1.1 200"):
            return sock
        sock.close()
        time.sleep(0.1)
    raise AssertionError("the server never accepted a connection below its cap")


def test_connections_beyond_the_cap_are_refused_with_503(guarded):
    cap = GUARDS["max_connections"]
    assert wait_until(lambda: open_connections(guarded) == 0)
    before = metric(guarded, "mlxvlm_connections_refused_total")
    held = []
    try:
        held = [held_connection(guarded.port) for _ in range(cap)]
        with raw_socket(guarded.port) as extra:
            error = assert_raw_error(read_response(extra), 503, code="server_busy")
            assert str(cap) in error["message"] and "--max-connections" in error["message"]
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: open_connections(guarded) == 0)
    assert metric(guarded, "mlxvlm_connections_refused_total") >= before + 1
    assert_serving(guarded)


def test_bodies_being_read_share_a_buffer_budget(guarded):
    stalled = raw_socket(guarded.port,
                         CHAT_HEAD + b"Content-Length: 149000\r\n\r\n" + b" " * 140_000)
    try:
        assert wait_until(lambda: metric(guarded, "mlxvlm_body_bytes_buffered") >= 140_000)
        error = assert_error(post(guarded, request("x" * 70_000)), 503, code="server_busy")
        assert "200000" in error["message"]
    finally:
        stalled.close()
    assert wait_until(lambda: metric(guarded, "mlxvlm_body_bytes_buffered") == 0)
    assert_serving(guarded)


def test_oversized_bodies_are_413(guarded):
    assert_error(post(guarded, request("x" * 200_000)), 413)
    assert_serving(guarded)


# -- the pixel budget ---------------------------------------------------------------------

def test_pixels_of_a_request_are_budgeted(guarded):
    """Five 50x50 images (12,500 pixels) against --max-request-pixels 10,000: refused,
    naming both; within the budget it works."""
    urls = [png_data_url(make_image(50, 50, seed)) for seed in range(5)]
    error = assert_error(post(guarded, request(user("Describe.", *urls))), 400,
                         code="too_many_pixels")
    assert "10,000" in error["message"] and "--max-request-pixels" in error["message"]
    assert "12,500" in error["message"]
    ok = post(guarded, request(user("Describe.", *urls[:3])))
    assert ok.status_code == 200, ok.text


def test_pixel_budget_is_checked_from_the_header_before_decoding(guarded):
    """The second image's header claims 100x100 pixels over a truncated body: the budget
    refuses it before its pixels are decoded (decoding would fail differently)."""
    import base64

    bomb = "data:image/png;base64," + base64.b64encode(bomb_png(100, 100)).decode()
    urls = [png_data_url(make_image(60, 60, 1)), bomb]
    error = assert_error(post(guarded, request(user("Describe.", *urls))), 400,
                         code="too_many_pixels")
    assert "13,600" in error["message"]


# -- requests that are not valid HTTP -----------------------------------------------------

@pytest.mark.parametrize("raw", [
    CHAT_HEAD + b"Content-Length: abc\r\n\r\n{}",
    CHAT_HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    CHAT_HEAD + b"Content-Length: -1\r\n\r\n{}",
    CHAT_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    CHAT_HEAD + b"Transfer-Encoding: gzip\r\n\r\n{}",
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n",
], ids=["length-not-a-number", "two-lengths", "negative-length", "bad-chunk-size",
        "unknown-transfer-coding", "no-request-line", "malformed-header"])
def test_protocol_errors_are_openai_shaped(guarded, raw):
    with raw_socket(guarded.port, raw) as sock:
        assert_raw_error(read_response(sock), 400, code="invalid_http")


def test_headers_too_large_are_431_in_one_piece_or_many(guarded):
    big = CHAT_HEAD + b"X-Big: " + b"a" * 40_000 + b"\r\n\r\nxx"
    with raw_socket(guarded.port, big) as sock:  # one send: h11 alone would parse it whole
        assert_raw_error(read_response(sock), 431, code="headers_too_large")
    with raw_socket(guarded.port, CHAT_HEAD) as sock:
        try:
            for _ in range(5):
                sock.sendall(b"X-More: " + b"b" * 5_000 + b"\r\n")
            sock.sendall(b"\r\n")
        except OSError:  # the server may answer and close before the rest is sent
            pass
        status, _, body = read_response(sock)
        assert status in (400, 431) and json.loads(body)["error"]["message"]
    assert_serving(guarded)


# -- clients pointed at the wrong URL ---------------------------------------------------

def test_a_base_url_without_v1_gets_a_hint(guarded):
    client = openai.OpenAI(base_url=guarded.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user",
                                                                  "content": "hi"}])
    message = caught.value.body["message"]
    assert "/v1/chat/completions" in message and f"{guarded.base_url}/v1" in message
    # A path that exists nowhere lists where the API is.
    error = assert_error(httpx.get(f"{guarded.base_url}/nothing-here"), 404, code="not_found")
    assert "/v1/chat/completions" in error["message"]
    # The Anthropic SDK's own base URL has no /v1: it works as given.
    answer = anthropic.Anthropic(base_url=guarded.base_url, api_key="unused",
                                 max_retries=0).messages.create(
        model=MODEL_ID, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert answer.stop_reason in ("max_tokens", "end_turn")


def test_the_guards_ran_without_errors(guarded):
    assert_serving(guarded)
    log = guarded.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


# -- keys, hosts and origins as given on the command line ----------------------------

def test_api_keys_hosts_and_origins(checkpoint, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# one per line\nkey-b\n")
    with ServerProcess("--model", checkpoint, "--served-model-name", MODEL_ID,
                       "--api-key", "key-a", "--api-key-file", str(keys),
                       "--allowed-origins", "http://ui.example",
                       "--allowed-hosts", "vlm.example") as server:
        url = f"{server.base_url}/v1/chat/completions"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "key-c"}):
            assert_error(httpx.post(url, json=request("hi"), headers=headers), 401,
                         code="invalid_api_key")
        for key in ("key-a", "key-b"):
            answer = server.openai_client(api_key=key).chat.completions.create(
                **request("hi"))
            assert answer.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(f"{server.base_url}/health").status_code == 200  # no key needed
        assert_error(httpx.get(f"{server.base_url}/metrics"), 401)
        # The Host check: loopback names and the allowed one; others are refused.
        assert httpx.get(f"{server.base_url}/health",
                         headers={"Host": "vlm.example"}).status_code == 200
        assert_error(httpx.get(f"{server.base_url}/health",
                               headers={"Host": "attacker.example"}), 421)
        # CORS for the allowed origin only.
        preflight = httpx.options(url, headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.headers.get("access-control-allow-origin") == "http://ui.example"
        denied = httpx.options(url, headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in denied.headers


# -- starting -----------------------------------------------------------------------------

def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    """The port is taken before the (possibly minutes-long) load: with a model path that
    does not exist, the port is what the server complains about."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "mlxvlm.server", "--model", str(tmp_path / "no-such-model"),
             "--port", str(port)], capture_output=True, text=True, timeout=120,
            env=user_environment())  # a user's process: torch-free
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert f"port {port}" in lines[0] and "--port" in lines[0]
