"""Tests for mlxvlm.media image loading: every kind of source, every failure path.

Offline and fast: images are written to tmp_path, and http(s) is served by a local
http.server on 127.0.0.1 in a background thread.
"""

from __future__ import annotations

import base64
import http.server
import io
import os
import socket
import struct
import threading
import urllib.parse
import zlib

import numpy as np
import pytest
from PIL import Image

from mlxvlm.media import sources
from mlxvlm.errors import MlxvlmError
from mlxvlm.media import MediaError, load_image, load_images

# ----------------------------------------------------------------------------- helpers

RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def encode(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def two_tone(size=(8, 4)) -> Image.Image:
    """Left half red, right half blue."""
    image = Image.new("RGB", size, BLUE)
    image.paste(RED, (0, 0, size[0] // 2, size[1]))
    return image


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height but carries only a few bytes of pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"\x78\x9c\x00")


def close(a, b, tol=8) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b))


def expect_error(source, *fragments: str, **kw) -> str:
    """load_image(source) must raise a one-line MediaError containing every fragment."""
    with pytest.raises(MediaError) as info:
        load_image(source, **kw)
    assert isinstance(info.value, ValueError) and isinstance(info.value, MlxvlmError)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith("cannot load image "), message
    assert len(message) < 400, message
    for fragment in fragments:
        assert fragment.lower() in message.lower(), (fragment, message)
    return message


@pytest.fixture
def png_path(tmp_path):
    path = tmp_path / "two_tone.png"
    path.write_bytes(encode(two_tone()))
    return path


def assert_two_tone(image: Image.Image, size=(8, 4)):
    assert isinstance(image, Image.Image)
    assert image.mode == "RGB"
    assert image.size == size
    assert image.getpixel((0, 0)) == RED
    assert image.getpixel((size[0] - 1, 0)) == BLUE


# ----------------------------------------------------------------------------- local files


def test_str_and_pathlib_paths(png_path):
    assert_two_tone(load_image(png_path))
    assert_two_tone(load_image(str(png_path)))


def test_tilde_is_expanded(png_path, monkeypatch):
    monkeypatch.setenv("HOME", str(png_path.parent))
    assert_two_tone(load_image("~/two_tone.png"))


def test_jpeg_exif_orientation_is_applied(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    path = tmp_path / "rotated.jpg"
    two_tone((40, 20)).save(path, "JPEG", exif=exif, quality=95)

    image = load_image(path)
    assert image.mode == "RGB"
    assert image.size == (20, 40)  # width and height swapped
    # Turning clockwise brings the red left half to the top.
    assert close(image.getpixel((10, 2)), RED, tol=30)
    assert close(image.getpixel((10, 37)), BLUE, tol=30)
    assert 0x0112 not in image.getexif()


def test_rgba_png_is_composited_on_white(tmp_path):
    rgba = Image.new("RGBA", (3, 1))
    rgba.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent black
    rgba.putpixel((1, 0), (255, 0, 0, 255))  # opaque red
    rgba.putpixel((2, 0), (0, 0, 0, 128))  # half transparent black
    path = tmp_path / "rgba.png"
    rgba.save(path)

    image = load_image(path)
    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) == WHITE
    assert image.getpixel((1, 0)) == RED
    assert close(image.getpixel((2, 0)), (127, 127, 127), tol=1)


def test_la_png_is_composited_on_white(tmp_path):
    path = tmp_path / "la.png"
    Image.new("LA", (2, 2), (0, 0)).save(path)
    image = load_image(path)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == WHITE


def palette_image() -> Image.Image:
    image = Image.new("P", (2, 1))
    image.putpalette([255, 0, 0, 0, 0, 255])  # index 0 red, 1 blue
    image.putpixel((1, 0), 1)
    return image


def test_palette_png(tmp_path):
    path = tmp_path / "palette.png"
    palette_image().save(path)
    image = load_image(path)
    assert image.mode == "RGB"
    assert [image.getpixel((x, 0)) for x in range(2)] == [RED, BLUE]


def test_palette_png_with_transparency_is_composited_on_white(tmp_path):
    path = tmp_path / "palette_t.png"
    palette_image().save(path, transparency=1)
    image = load_image(path)
    assert [image.getpixel((x, 0)) for x in range(2)] == [RED, WHITE]


def test_grayscale_and_16_bit_png(tmp_path):
    path = tmp_path / "gray.png"
    Image.new("L", (2, 2), 77).save(path)
    assert load_image(path).getpixel((0, 0)) == (77, 77, 77)

    path16 = tmp_path / "gray16.png"
    Image.new("I;16", (2, 2), 40000).save(path16)
    assert load_image(path16).getpixel((0, 0)) == (156, 156, 156)  # 40000 >> 8, not clipped


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.png", "nope.png", "no such file", "check the path")


def test_directory(tmp_path):
    expect_error(tmp_path, "is a directory")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.png"
    path.touch()
    expect_error(path, "empty.png", "is empty")


def test_corrupt_file(tmp_path):
    path = tmp_path / "truncated.png"
    path.write_bytes(encode(two_tone((64, 64)))[:-40])
    expect_error(path, "truncated.png", "corrupt")


def test_not_an_image(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, not an image\n")
    expect_error(path, "notes.txt", "not a recognised image format", "PNG, JPEG")


def test_file_larger_than_max_bytes(png_path):
    expect_error(png_path, "larger than the limit", "max_bytes",
                 max_bytes=png_path.stat().st_size - 1)
    assert_two_tone(load_image(png_path, max_bytes=png_path.stat().st_size))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    expect_error(fifo, "not a regular file")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root can read any file")
def test_unreadable_file(png_path):
    png_path.chmod(0)
    try:
        expect_error(png_path, "permission denied")
    finally:
        png_path.chmod(0o644)


def test_long_path_is_shortened_in_message(tmp_path):
    path = tmp_path / ("x" * 200 + ".png")
    message = expect_error(str(path)[:250] + "/y.png", "no such file", "...")
    assert "y.png" in message  # the end of the path (the file name) stays visible


def test_empty_path():
    expect_error("", "empty")


# ----------------------------------------------------------------------------- allowed_dir


@pytest.fixture
def sandbox(tmp_path):
    """(allowed dir holding ok.png, an outside dir holding secret.png)."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "ok.png").write_bytes(encode(two_tone()))
    (outside / "secret.png").write_bytes(encode(two_tone()))
    return allowed, outside


def test_allowed_dir_inside(sandbox):
    allowed, _ = sandbox
    assert_two_tone(load_image(allowed / "ok.png", allowed_dir=allowed))
    assert_two_tone(load_image(str(allowed / "ok.png"), allowed_dir=str(allowed)))


def test_allowed_dir_outside(sandbox):
    allowed, outside = sandbox
    expect_error(outside / "secret.png", "outside the allowed directory", allowed_dir=allowed)
    expect_error(allowed / ".." / "outside" / "secret.png", "outside the allowed directory",
                 allowed_dir=allowed)


def test_allowed_dir_does_not_reveal_whether_outside_files_exist(sandbox):
    allowed, outside = sandbox
    message = expect_error(outside / "missing.png", "outside the allowed directory",
                           allowed_dir=allowed)
    assert "no such file" not in message


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_allowed_dir_symlink_escape(sandbox):
    allowed, outside = sandbox
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "linkdir").symlink_to(outside, target_is_directory=True)
    expect_error(allowed / "link.png", "outside the allowed directory", allowed_dir=allowed)
    expect_error(allowed / "linkdir" / "secret.png", "outside the allowed directory",
                 allowed_dir=allowed)
    # Without allowed_dir (the CLI), symlinks are followed as usual.
    assert_two_tone(load_image(allowed / "link.png"))


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_allowed_dir_symlink_inside_is_fine(sandbox, tmp_path):
    allowed, _ = sandbox
    (allowed / "alias.png").symlink_to(allowed / "ok.png")
    assert_two_tone(load_image(allowed / "alias.png", allowed_dir=allowed))
    # allowed_dir itself may be reached through a symlink.
    (tmp_path / "allowed_link").symlink_to(allowed, target_is_directory=True)
    assert_two_tone(load_image(allowed / "ok.png", allowed_dir=tmp_path / "allowed_link"))


def test_allow_local_false_refuses_every_path(sandbox):
    allowed, _ = sandbox
    expect_error(allowed / "ok.png", "local files is disabled", "data url",
                 allow_local=False, allowed_dir=allowed)
    expect_error(str(allowed / "ok.png"), "local files is disabled", allow_local=False)
    # Sources that are not local files still work.
    assert_two_tone(load_image(encode(two_tone()), allow_local=False))
    assert_two_tone(load_image(data_url(encode(two_tone())), allow_local=False))


# ----------------------------------------------------------------------------- pixel limits


def test_too_many_pixels(png_path):
    expect_error(png_path, "8x4 = 32 pixels", "limit of 31", "max_pixels", max_pixels=31)
    assert_two_tone(load_image(png_path, max_pixels=32))


def test_pixel_limit_is_checked_before_decoding():
    # The pixel data is truncated: decoding it would fail with "corrupt". The limit must
    # fire first, from the header alone.
    expect_error(png_header(100, 100), "more than the limit", max_pixels=9_999)
    expect_error(png_header(100, 100), "corrupt")


def test_decompression_bombs_become_media_errors(monkeypatch):
    # Over twice Pillow's limit: Pillow raises DecompressionBombError in Image.open.
    expect_error(png_header(100_000, 100_000), "decompression bomb",
                 max_pixels=10**12)
    # Over Pillow's limit: Pillow warns (DecompressionBombWarning), we refuse.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)
    expect_error(encode(Image.new("RGB", (40, 40))), "decompression bomb", max_pixels=10**6)


def test_pixel_limit_applies_to_arrays_and_pil_images():
    expect_error(np.zeros((10, 10, 3), np.uint8), "more than the limit", max_pixels=99)
    expect_error(Image.new("RGB", (10, 10)), "more than the limit", max_pixels=99)


# ----------------------------------------------------------------------------- bytes, PIL, numpy


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_raw_bytes(wrap):
    assert_two_tone(load_image(wrap(encode(two_tone()))))


def test_raw_bytes_errors():
    expect_error(b"", "<0 bytes>", "empty")
    expect_error(b"garbage" * 10, "<70 bytes>", "not a recognised image format")
    expect_error(encode(two_tone()), "larger than the limit", max_bytes=10)


def test_jpeg_bytes():
    image = load_image(encode(two_tone((32, 16)), "JPEG", quality=95))
    assert image.size == (32, 16)
    assert close(image.getpixel((2, 8)), RED, tol=30)


def test_pil_image_is_converted_not_modified():
    rgba = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    image = load_image(rgba)
    assert image is not rgba and rgba.mode == "RGBA"
    assert image.mode == "RGB" and image.getpixel((0, 0)) == WHITE

    rgb = two_tone()
    image = load_image(rgb)
    assert image is not rgb
    assert_two_tone(image)


def test_pil_image_exif_orientation(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 8  # rotate 90 degrees counter-clockwise to display
    path = tmp_path / "o8.jpg"
    two_tone((40, 20)).save(path, "JPEG", exif=exif, quality=95)
    with Image.open(path) as opened:
        image = load_image(opened)
    assert image.size == (20, 40)
    assert close(image.getpixel((10, 37)), RED, tol=30)  # the left half ends up at the bottom


def test_numpy_arrays():
    rgb = np.zeros((4, 8, 3), np.uint8)
    rgb[:, :4] = RED
    rgb[:, 4:] = BLUE
    assert_two_tone(load_image(rgb))
    assert_two_tone(load_image(np.ascontiguousarray(rgb[:, ::-1])[:, ::-1]))  # strided view

    gray = np.full((3, 5), 200, np.uint8)
    for array in (gray, gray[:, :, None]):
        image = load_image(array)
        assert image.mode == "RGB" and image.size == (5, 3)
        assert image.getpixel((0, 0)) == (200, 200, 200)

    rgba = np.zeros((2, 2, 4), np.uint8)  # transparent
    assert load_image(rgba).getpixel((0, 0)) == WHITE


def test_numpy_result_does_not_share_memory():
    array = np.zeros((2, 2, 3), np.uint8)
    image = load_image(array)
    array[:] = 255
    assert image.getpixel((0, 0)) == (0, 0, 0)


def test_numpy_errors():
    expect_error(np.zeros((4, 4, 3), np.float32), "dtype float32", "uint8")
    expect_error(np.zeros((4, 4, 2), np.uint8), "shape (4, 4, 2)")
    expect_error(np.zeros((2, 4, 4, 3), np.uint8), "shape (2, 4, 4, 3)")
    expect_error(np.zeros((0, 4, 3), np.uint8), "no pixels")


def test_unsupported_source_type():
    expect_error(12345, "<int>", "unsupported source type")
    expect_error("ftp://example.com/a.png", "ftp:// urls are not supported")


# ----------------------------------------------------------------------------- data URLs


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def test_data_url():
    png = encode(two_tone())
    assert_two_tone(load_image(data_url(png)))
    # Line-wrapped base64, missing padding, URL-safe alphabet, generic media type.
    wrapped = base64.encodebytes(png).decode()
    assert_two_tone(load_image("data:image/png;base64," + wrapped))
    assert_two_tone(load_image(data_url(png).rstrip("=")))
    urlsafe = base64.urlsafe_b64encode(png).decode()
    assert_two_tone(load_image("data:image/png;base64," + urlsafe))
    assert_two_tone(load_image(data_url(png, "application/octet-stream")))
    assert_two_tone(load_image("DATA:image/PNG;BASE64," + base64.b64encode(png).decode()))
    assert_two_tone(load_image("data:image/png," + urllib.parse.quote_from_bytes(png)))


def test_data_url_errors():
    expect_error("data:image/png;base64,!!!not base64!!!", "not valid base64",
                 "data:image/<format>;base64")
    expect_error("data:image/png;base64", "no ','")
    expect_error("data:image/png;base64,", "empty")
    expect_error(data_url(b"hello", "text/plain"), "media type is 'text/plain'")
    expect_error(data_url(encode(two_tone())), "larger than the limit", max_bytes=50)
    expect_error(data_url(b"not an image at all"), "not a recognised image format")


def test_data_url_payload_is_never_dumped():
    payload = base64.b64encode(os.urandom(30_000)).decode()
    message = expect_error("data:image/png;base64," + payload, "not a recognised image format")
    assert payload[:40] not in message
    assert "'data:image/png;base64,...'" in message
    assert f"({len(payload) + 22} chars)" in message


# ----------------------------------------------------------------------------- http(s)

PNG = encode(two_tone())
BIG = b"\0" * 5_000


class _Handler(http.server.BaseHTTPRequestHandler):
    user_agents: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's naming)
        type(self).user_agents.append(self.headers.get("User-Agent", ""))
        path = self.path.split("?")[0]
        if path == "/img.png":
            self._send(200, PNG, "image/png")
        elif path == "/big":
            self._send(200, BIG, "image/png")
        elif path == "/big-no-length":  # HTTP/1.0, body ends when the connection closes
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(BIG)
        elif path == "/page.html":
            self._send(200, b"<html>login</html>", "text/html; charset=utf-8")
        elif path == "/empty":
            self._send(200, b"", "image/png")
        elif path == "/redirect":
            self._redirect("/img.png")
        elif path == "/redirect-ftp":
            self._redirect("ftp://127.0.0.1/img.png")
        elif path == "/redirect-file":
            self._redirect("file:///etc/passwd")
        else:
            self._send(404, b"not found", "text/plain")

    def _send(self, code, body, content_type):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):  # keep test output quiet
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch):
    """A proxy from the environment must not intercept requests to 127.0.0.1."""
    for var in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.upper(), raising=False)


def test_http_image(server):
    _Handler.user_agents.clear()
    assert_two_tone(load_image(f"{server}/img.png", timeout=5))
    assert _Handler.user_agents[-1].startswith("mlxvlm")


def test_http_redirect(server):
    assert_two_tone(load_image(f"{server}/redirect", timeout=5))


def test_http_redirect_to_other_schemes_is_refused(server):
    expect_error(f"{server}/redirect-ftp", "redirected to 'ftp://127.0.0.1/img.png'",
                 "not an http(s) url", timeout=5)
    expect_error(f"{server}/redirect-file", "redirection", "not allowed", timeout=5)


def test_http_404(server):
    expect_error(f"{server}/missing.png", "/missing.png", "HTTP 404", "check the URL", timeout=5)


def test_http_body_larger_than_max_bytes(server):
    expect_error(f"{server}/big", "larger than the limit", max_bytes=1_000, timeout=5)
    # Without a Content-Length, reading stops after max_bytes + 1 bytes.
    expect_error(f"{server}/big-no-length", "larger than the limit", max_bytes=1_000, timeout=5)


def test_http_not_an_image_names_the_content_type(server):
    expect_error(f"{server}/page.html", "not a recognised image format", "text/html", timeout=5)


def test_http_empty_body(server):
    expect_error(f"{server}/empty", "empty body", timeout=5)


def test_remote_disabled():
    # Refused before any network access: the host does not even resolve.
    expect_error("https://example.invalid/cat.png", "remote urls is disabled",
                 "allow_remote=True", allow_remote=False)


def test_http_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    expect_error(f"http://127.0.0.1:{port}/img.png", "could not connect", timeout=5)


def test_http_timeout():
    # A listening socket that never accepts: the connection completes, no answer comes.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        expect_error(f"http://127.0.0.1:{port}/img.png", "timed out after 0.2 s", timeout=0.2)


def test_http_total_download_deadline(server, monkeypatch):
    # A server that keeps sending must not hold the caller past the deadline; a fake
    # clock makes the deadline pass after the first chunk instead of waiting for it.
    ticks = iter([0.0] + [1e9] * 100)
    monkeypatch.setattr(sources, "_clock", lambda: next(ticks))
    expect_error(f"{server}/big-no-length", "timed out", timeout=5)


def test_url_credentials_are_not_shown(server):
    host = server.removeprefix("http://")
    message = expect_error(f"http://user:hunter2@{host}/missing.png", timeout=5)
    assert "hunter2" not in message


# ----------------------------------------------------------------------------- load_images


def test_load_images(png_path):
    images = load_images([png_path, encode(two_tone()), two_tone()])
    assert len(images) == 3
    for image in images:
        assert_two_tone(image)


def test_load_images_names_the_bad_source(png_path, tmp_path):
    with pytest.raises(MediaError, match=r"^sources\[1\]: cannot load image .*no such file"):
        load_images([png_path, tmp_path / "missing.png"])
    with pytest.raises(MediaError, match="outside the allowed directory"):
        load_images([png_path], allowed_dir=tmp_path / "elsewhere")


def test_load_images_refuses_a_single_source(png_path):
    with pytest.raises(TypeError, match="load_image"):
        load_images(str(png_path))


# -- the pixel budget of a request -------------------------------------------------------

def _png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def test_pixel_budget_refuses_from_the_header_without_decoding(monkeypatch):
    from PIL import ImageFile

    from mlxvlm.media import PixelBudget, PixelBudgetError, load_image

    budget = PixelBudget(per_request=5_000, total=100_000)
    decoded = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load",
                        lambda self: decoded.append(self.size) or real_load(self))
    with budget.request() as account:
        load_image(_png(50, 60))  # 3,000
        assert decoded and account.used == 3_000 and budget.in_use == 3_000
        before = len(decoded)
        with pytest.raises(PixelBudgetError, match=r"6,000 decoded pixels.*limit of 5,000") as e:
            load_image(_png(50, 60))
        assert not e.value.shared
        assert len(decoded) == before  # the refused image was never decoded
    assert budget.in_use == 0  # given back when the request ends
    load_image(_png(500, 500))  # outside a request: no budget


def test_pixel_budget_is_shared_by_requests_being_prepared():
    from mlxvlm.media import PixelBudget, PixelBudgetError, load_image

    budget = PixelBudget(per_request=4_000, total=5_000)
    with budget.request():
        load_image(_png(60, 50))  # 3,000 held by the first request
        with budget.request():
            with pytest.raises(PixelBudgetError, match="5,000") as e:
                load_image(_png(60, 50))
            assert e.value.shared
        assert budget.in_use == 3_000
    assert budget.in_use == 0


def test_default_pixel_budget_follows_memory(monkeypatch):
    from mlxvlm.media import budget

    monkeypatch.setattr(budget, "physical_memory", lambda: 16 * 2**30)
    assert budget.default_pixel_budget() == (16 * 2**30 // 64 // 4, 16 * 2**30 // 64)
