"""Bad input gets the right 4xx in OpenAI's error shape, and the server keeps serving:
malformed JSON, wrong types, out-of-range values, unknown model, bad or hostile images,
SSRF targets (IPv6 forms of private IPv4 addresses included), path traversal, oversized
bodies, too many pixels, prompts longer than the context, missing or wrong API keys,
cross-site requests (wrong Content-Type or Host). (Sampling fields: see
tests/test_sampling_validation.py; slow or vanishing clients, too many connections, the
pixel and body budgets, requests that are not valid HTTP and API keys are tested through
``python -m mlxvlm.server`` itself in tests/test_server_entry_point.py.)

Network tests only ever talk to listeners on loopback addresses; every other address
(10.x, 169.254.x) must be refused before any connection is attempted.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import threading

import httpx
import openai
import pytest
from server_harness import MODEL_ID, LiveServer, bomb_png, png_data_url, user
from tiny import make_image

import mlxvlm
from mlxvlm.media import public_net

MAX_BODY = 300_000


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media-root")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    make_image(40, 40, 1).save(allowed / "ok.png")
    make_image(40, 40, 2).save(outside / "secret.png")
    os.symlink(outside / "secret.png", allowed / "link.png")
    return allowed


@pytest.fixture(scope="module")
def server(loaded, media_dir):
    with LiveServer(*loaded, allow_remote_media=True, allowed_media_dir=str(media_dir),
                    max_body_bytes=MAX_BODY, media_timeout=5.0) as live:
        yield live


class CountingListener:
    """An HTTP server on a loopback address that counts the connections it accepts.
    ``/redirect?to=URL`` answers 302 to URL; anything else gets a small PNG."""

    def __init__(self, host: str):
        self.connections = 0
        png = make_image(32, 32, 3)
        import io

        buffer = io.BytesIO()
        png.save(buffer, "PNG")
        body = buffer.getvalue()
        listener = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.startswith("/redirect?to="):
                    self.send_response(302)
                    self.send_header("Location", self.path[len("/redirect?to="):])
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            def verify_request(self, request, client_address):
                listener.connections += 1
                return True

        self.server = Server((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def listener():
    served = CountingListener("127.0.0.1")
    yield served
    served.close()


def post(server, body, **kwargs) -> httpx.Response:
    content = json.dumps(body) if isinstance(body, (dict, list)) else body
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{server.base_url}/v1/chat/completions", content=content,
                      headers=headers, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, *, contains: str | None = None,
                 param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if contains is not None:
        assert contains.lower() in error["message"].lower(), error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def request(content, **fields) -> dict:
    messages = [content] if isinstance(content, dict) else [{"role": "user", "content": content}]
    return {"model": MODEL_ID, "messages": messages, "max_tokens": 4, "temperature": 0, **fields}


def image_request(url: str) -> dict:
    return request(user("Describe.", url))


def data_url(payload: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(payload).decode()


@pytest.mark.parametrize("body, contains", [
    (b'{"model": "x", "messages": [', "json"),
    (b"[1, 2, 3]", None),
    (b"", "json"),
    (b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
])
def test_malformed_json(server, body, contains):
    error = assert_error(post(server, body), 400, contains=contains)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("fields, param", [
    ({"messages": "hello"}, "messages"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"seed": "42"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 7}]}]},
     "messages.0.content"),
    ({"model": 3}, "model"),
])
def test_wrong_types(server, fields, param):
    error = assert_error(post(server, request("hi", **fields)), 400)
    assert error["param"].startswith(param)


@pytest.mark.parametrize("fields, contains", [
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "logprobs"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"n": 0}, "n"),
    ({"n": 3}, "n > 1"),
    ({"messages": []}, "messages"),
    ({"stream_options": {"include_usage": True}}, "stream"),
    ({"logit_bias": {"abc": 1}}, "token ids"),
    ({"logit_bias": {"999999": 1}}, "vocabulary"),
    ({"stop": ["s"] * 17}, "stop"),
])
def test_out_of_range_values(server, fields, contains):
    assert_error(post(server, request("hi", **fields)), 400, contains=contains)


def test_unknown_model_is_404(server):
    assert_error(post(server, request("hi", model="gpt-4o")), 404, param="model",
                 code="model_not_found", contains="gpt-4o")


@pytest.mark.parametrize("part, contains", [
    # This model takes neither, and the data is not audio or video anyway.
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, None),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, None),
    ({"type": "hologram", "hologram": {}}, "hologram"),
])
def test_unsupported_content_parts(server, part, contains):
    assert_error(post(server, request([part, {"type": "text", "text": "hi"}])), 400,
                 contains=contains)


@pytest.mark.parametrize("url, contains", [
    ("data:image/png;base64,!!!not-base64!!!", "base64"),
    (data_url(b"hello, I am not an image"), "not a recognised image"),
    (data_url(b"GIF89a" + b"\0" * 10), "image"),
    (data_url(bomb_png()), "pixels"),
    (data_url(b"hello", "text/plain"), "text/plain"),
    ("ftp://example.com/cat.png", "ftp"),
])
def test_bad_images(server, url, contains):
    assert_error(post(server, image_request(url)), 400, contains=contains, code="invalid_media")


def test_local_paths_stay_inside_the_allowed_folder(server, media_dir):
    assert post(server, image_request(str(media_dir / "ok.png"))).status_code == 200
    for path in (
        str(media_dir / ".." / "outside" / "secret.png"),  # ..
        str(media_dir / "link.png"),  # a symlink out of the folder
        "/etc/passwd",
        "file:///etc/passwd",
    ):
        assert_error(post(server, image_request(path)), 400, code="invalid_media")


@pytest.mark.parametrize("target", [
    "http://127.0.0.1:{port}/cat.png",
    "http://localhost:{port}/cat.png",
    "http://[::1]:{port}/cat.png",
    "http://[::ffff:127.0.0.1]:{port}/cat.png",
    "http://0x7f000001:{port}/cat.png",
    "http://10.0.0.1/cat.png",
    "http://192.168.1.1/cat.png",
    "http://169.254.169.254/latest/meta-data/",
    "http://0.0.0.0:{port}/cat.png",
])
def test_ssrf_targets_are_refused_before_connecting(server, listener, target):
    before = listener.connections
    url = target.format(port=listener.port)
    assert_error(post(server, image_request(url)), 400, contains="not a public internet address")
    assert listener.connections == before


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2001:4860:4860::8888", True),
    ("127.0.0.1", False), ("127.8.9.1", False), ("10.1.1.1", False), ("172.16.0.1", False),
    ("192.168.0.1", False), ("169.254.1.1", False), ("100.64.0.1", False), ("0.0.0.0", False),
    ("224.0.0.1", False), ("255.255.255.255", False), ("::1", False), ("fe80::1%eth0", False),
    ("fc00::1", False), ("::ffff:10.0.0.1", False), ("2002:a00:1::", False), ("::", False),
])
def test_public_address_classification(address, public):
    assert public_net.is_public_address(address) is public


def test_redirects_to_private_targets_are_refused(server, listener, monkeypatch):
    """Treat the loopback listener as public for this test, so that its redirects can
    be followed to targets that must still be refused."""
    real = public_net.is_public_address
    monkeypatch.setattr(public_net, "is_public_address",
                        lambda address: address == "127.0.0.1" or real(address))
    second = CountingListener("127.0.0.2")
    try:
        base = f"http://127.0.0.1:{listener.port}"
        # The allowed first hop works end to end.
        assert post(server, image_request(f"{base}/cat.png")).status_code == 200
        for target in (f"http://127.0.0.2:{second.port}/cat.png",
                       "http://169.254.169.254/latest/meta-data/",
                       "http://10.1.2.3/cat.png"):
            before = listener.connections
            response = post(server, image_request(f"{base}/redirect?to={target}"))
            assert_error(response, 400, contains="not a public internet address")
            assert listener.connections == before + 1  # the first hop only
        assert second.connections == 0
    finally:
        second.close()


def test_oversized_bodies_are_413(server):
    padding = "x" * (MAX_BODY + 1000)
    assert_error(post(server, request(padding)), 413, code="request_too_large")

    def chunked():  # no Content-Length: the cap applies while reading
        yield b'{"model": "' + MODEL_ID.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 10_000
        yield b'"}]}'

    assert_error(post(server, chunked()), 413)


def test_too_long_prompt_names_both_lengths(server):
    error = assert_error(post(server, request("garden " * 1100)), 400,
                         code="context_length_exceeded")
    assert "1024" in error["message"] and "tokens long" in error["message"]


def test_wrong_routes_and_methods(server):
    assert_error(httpx.get(f"{server.base_url}/v1/chat/completions"), 405)
    assert_error(httpx.get(f"{server.base_url}/v1/nothing-here"), 404)
    assert httpx.get(f"{server.base_url}/docs").status_code == 404


# -- SSRF through IPv6 forms of private IPv4 addresses ----------------------------------

# Names the fake resolver answers, each with an IPv6 form of a loopback or metadata
# address (see tests/test_public_net.py for the forms).
HOSTILE_NAMES = {
    "nat64.rebind.test": "64:ff9b::a9fe:a9fe",  # 169.254.169.254
    "nat64-local.rebind.test": "64:ff9b:1::7f00:1",
    "compatible.rebind.test": "::7f00:1",  # ::127.0.0.1
    "mapped.rebind.test": "::ffff:127.0.0.1",
    "translated.rebind.test": "::ffff:0:a9fe:a9fe",
    "sixtofour.rebind.test": "2002:a9fe:a9fe::1",
    "teredo.rebind.test": "2001:0:4136:e378:8000:edcb:80ff:fffe",  # client 127.0.0.1
}


@pytest.fixture
def hostile_dns(monkeypatch):
    """Resolve the names above to their addresses (anything else as usual), and make sure
    that nothing is ever connected to if a check lets one through."""
    real_getaddrinfo = public_net.socket.getaddrinfo
    real_public_addresses = public_net.public_addresses

    def getaddrinfo(host, port, *args, **kwargs):
        if host in HOSTILE_NAMES:
            return [(public_net.socket.AF_INET6, public_net.socket.SOCK_STREAM, 6, "",
                     (HOSTILE_NAMES[host], port, 0, 0))]
        return real_getaddrinfo(host, port, *args, **kwargs)

    def public_addresses(host, port):
        checked = real_public_addresses(host, port)
        if host in HOSTILE_NAMES:
            raise OSError(f"the check let {host} through")  # never connect there
        return checked

    monkeypatch.setattr(public_net.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(public_net, "public_addresses", public_addresses)


@pytest.mark.parametrize("name", sorted(HOSTILE_NAMES))
def test_ipv6_forms_of_private_addresses_are_refused(server, hostile_dns, name):
    error = assert_error(post(server, image_request(f"http://{name}/cat.png")), 400,
                         contains="not a public internet address", code="invalid_media")
    assert HOSTILE_NAMES[name].split(":")[0] in error["message"]


# -- cross-site requests: Content-Type and Host ---------------------------------------

@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_json_endpoints_need_a_json_content_type(server, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    response = httpx.post(f"{server.base_url}/v1/chat/completions",
                          content=json.dumps(request("hi")), headers=headers, timeout=60)
    assert_error(response, 415, contains="application/json", code="unsupported_media_type")


def test_json_content_type_may_carry_parameters(server):
    response = post(server, request("hi"), headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "10.0.0.1", "[::2]:80", ""])
def test_loopback_server_refuses_other_host_names(server, host):
    response = httpx.get(f"{server.base_url}/v1/models", headers={"Host": host})
    assert_error(response, 421, code="invalid_host")
    assert_error(post(server, request("hi"), headers={"Host": host}), 421)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:9999", "127.0.0.1", "127.0.0.1:1",
                                  "[::1]", "[::1]:8080", "LocalHost:80"])
def test_loopback_server_answers_loopback_host_names(server, host):
    response = httpx.get(f"{server.base_url}/v1/models", headers={"Host": host})
    assert response.status_code == 200, response.text


def test_allowed_hosts_widen_the_host_check(loaded):
    with LiveServer(*loaded, allowed_hosts=["api.example", "Other.Example"]) as widened:
        for host in ("api.example", "other.example:443", "localhost"):
            assert httpx.get(f"{widened.base_url}/health", headers={"Host": host}).status_code == 200
        assert_error(httpx.get(f"{widened.base_url}/health", headers={"Host": "evil.example"}), 421)
    with LiveServer(*loaded, allowed_hosts=["*"]) as anything:
        assert httpx.get(f"{anything.base_url}/health",
                         headers={"Host": "evil.example"}).status_code == 200
    # Bound to all addresses (the socket itself is still on loopback here): any name,
    # unless --allowed-hosts says which.
    with LiveServer(*loaded, host="0.0.0.0") as public:
        assert httpx.get(f"{public.base_url}/health",
                         headers={"Host": "192.0.2.7:8080"}).status_code == 200
    with LiveServer(*loaded, host="0.0.0.0", allowed_hosts=["vlm.example"]) as named:
        assert httpx.get(f"{named.base_url}/health", headers={"Host": "vlm.example"}).status_code == 200
        assert_error(httpx.get(f"{named.base_url}/health", headers={"Host": "192.0.2.7"}), 421)


# -- API keys: several, and prefix reuse confined to one ----------------------------------------

def test_several_api_keys_and_per_key_prefix_reuse(loaded, tmp_path):
    image = png_data_url(make_image(40, 40, 9))
    messages = [user("Describe the picture in detail.", image)]
    with LiveServer(*loaded, api_keys=["key-a", "key-b"]) as secured:
        def cached(key: str) -> int:
            answer = secured.client(api_key=key).chat.completions.create(
                model=MODEL_ID, messages=messages, max_tokens=2, temperature=0)
            return answer.usage.prompt_tokens_details.cached_tokens

        assert cached("key-a") == 0
        assert cached("key-a") > 0  # the same client reuses its own prefix
        assert cached("key-b") == 0  # another client learns nothing from it
        assert cached("key-b") > 0
        with pytest.raises(openai.AuthenticationError):
            secured.client(api_key="key-c").models.list()
    # Without keys the cache is shared by everyone (documented in docs/server.md).
    with LiveServer(*loaded) as open_server:
        client = open_server.client()
        client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=2,
                                       temperature=0)
        again = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=2,
                                               temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_the_server_kept_serving(server):
    client = server.client()
    response = client.chat.completions.create(
        model=MODEL_ID, messages=[user("Describe.", png_data_url(make_image(40, 40, 4)))],
        max_tokens=4, temperature=0)
    assert response.choices[0].message.content is not None
    assert server.service.in_flight == 0
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'mlxvlm_requests_total{status="400"}' in metrics
    assert 'mlxvlm_requests_total{status="413"}' in metrics


def test_remote_and_local_media_are_off_by_default(loaded, listener, media_dir):
    with LiveServer(*loaded) as default:
        remote = image_request(f"http://127.0.0.1:{listener.port}/cat.png")
        before = listener.connections
        assert_error(post(default, remote), 400, contains="remote")
        assert listener.connections == before
        assert_error(post(default, image_request(str(media_dir / "ok.png"))), 400,
                     contains="local files")
        assert httpx.get(f"{default.base_url}/v1/models",
                         headers={"Origin": "http://evil.example"}).headers.get(
            "access-control-allow-origin") is None
