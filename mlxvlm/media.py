"""Loading media -- images, video frames and audio -- from user input.

Every loader takes the same kinds of *source* and the same limits, and every failure is a
one-line :class:`MediaError` that names the input (shortened), says what was wrong and
what to do about it.

The module is layered so that video and audio reuse the lower half:

1. naming and errors     -- :class:`MediaError`, :func:`describe_source`, :func:`_error`
2. getting the bytes     -- :func:`_local_path` (``allowed_dir`` policy), :func:`_read_file`,
                            :func:`_fetch_url`, :func:`_decode_data_url`, and
                            :func:`_read_source_bytes` which dispatches on the source kind
3. decoding              -- images: :func:`_decode_image`, :func:`_to_rgb`, :func:`load_image`;
                            video and audio with PyAV: :func:`load_video` (frames sampled at
                            ``fps`` within a pixel budget, plus the sound track) and
                            :func:`load_audio` (mono float32, resampled)

Decoding untrusted input is the risky part, so the limits are enforced as early as
possible: ``max_bytes`` before a body is read in full (Content-Length, file size, base64
length), ``max_pixels`` from the image header before any pixel data is decoded, a video's
frame size from its header and the pixels of all its sampled frames before decoding, and
an audio's length while it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import contextvars
import http.client
import io
import logging
import os
import re
import socket
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mlxvlm.errors import MlxvlmError
from mlxvlm.public_net import BlockedAddressError, public_only_handlers

__all__ = [
    "MediaError", "ImageSource", "load_image", "load_images", "describe_source",
    "Video", "Audio", "load_video", "load_audio", "resample_audio",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_BYTES = 50 * 2**20
# Pillow's own default for Image.MAX_IMAGE_PIXELS (~ a 13k x 13k image).
DEFAULT_MAX_PIXELS = 178_956_970

ImageSource = Union[Image.Image, str, "os.PathLike[str]", bytes, bytearray, memoryview, np.ndarray]

_NAME_LIMIT = 80
_READ_CHUNK = 1 << 16
_REMOTE_SCHEMES = ("http", "https")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_clock = time.monotonic  # a seam for tests of the download deadline


# --------------------------------------------------------------------------- naming, errors


class MediaError(MlxvlmError, ValueError):
    """An input image, video or audio could not be loaded.

    The message is one line: which input, what went wrong, and what to do. As an
    :class:`~mlxvlm.errors.MlxvlmError` the CLIs print it as such and exit with code 2.
    """


def _shorten(text: str, limit: int = _NAME_LIMIT) -> str:
    """Shorten from the middle, so both the start and the file name stay visible."""
    if len(text) <= limit:
        return text
    head = (limit - 3) * 2 // 3
    tail = limit - 3 - head
    return f"{text[:head]}...{text[-tail:]}"


def _redact_url(url: str) -> str:
    """Hide credentials in ``user:password@host`` URLs."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"***@{host}"))


def describe_source(source: Any) -> str:
    """A short, single-line name for ``source`` to put in messages and logs.

    Paths and URLs are cut to about 80 characters; a data URL shows only its header and
    length, never its payload.
    """
    if isinstance(source, os.PathLike):
        source = os.fsdecode(source)
    if isinstance(source, str):
        if source[:5].lower() == "data:":
            header = source[: source.find(",")] if "," in source[:200] else source[:40]
            return f"'{_shorten(header, 60)},...' ({len(source)} chars)"
        if _SCHEME_RE.match(source):
            source = _redact_url(source)
        # repr() escapes newlines and control characters, keeping the message one line.
        return repr(_shorten(source))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{len(source)} bytes>"
    if isinstance(source, np.ndarray):
        return f"<array shape={tuple(source.shape)} dtype={source.dtype}>"
    if isinstance(source, Image.Image):
        return f"<PIL image {source.mode} {source.width}x{source.height}>"
    return f"<{type(source).__name__}>"


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _error(kind: str, name: str, reason: str, fix: str | None = None) -> MediaError:
    message = f"cannot load {kind} {name}: {_one_line(reason)}"
    if fix:
        message += f"; {_one_line(fix)}"
    return MediaError(message)


def _with_article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n} bytes"


def _too_big(kind: str, name: str, size: str, max_bytes: int) -> MediaError:
    return _error(
        kind, name, f"{size} is larger than the limit of {_mb(max_bytes)}",
        "use a smaller file, or raise max_bytes",
    )


# --------------------------------------------------------------------------- getting the bytes


def _local_path(source: str | os.PathLike, allowed_dir: str | os.PathLike | None, kind: str,
                name: str) -> Path:
    """The path to open for a local ``source``, enforcing ``allowed_dir``.

    With ``allowed_dir`` the path is resolved (following every symlink) and must lie
    inside the resolved ``allowed_dir``; the check comes before any existence check so
    that it does not reveal which files exist elsewhere. The resolved path is returned,
    and :func:`_read_file` opens it without following a final symlink, so the file read
    is the one checked.
    """
    text = os.fspath(source)
    if not text:
        raise _error(kind, name, "the path is empty", "pass a file path, URL or data URL")
    if "\0" in text:
        raise _error(kind, name, "the path contains a NUL character", "check the path")
    path = Path(text).expanduser()
    if allowed_dir is None:
        return path
    root = Path(allowed_dir).expanduser().resolve()
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as e:  # symlink loops
        raise _error(kind, name, f"cannot resolve the path ({e.__class__.__name__})",
                     "check the path") from e
    if not resolved.is_relative_to(root):
        raise _error(
            kind, name, f"the path is outside the allowed directory {str(root)!r}",
            "put the file inside that directory, or send it as a data URL",
        )
    return resolved


def _open_regular_file(path: Path, *, max_bytes: int, no_follow: bool, kind: str,
                       name: str) -> int:
    """Open a regular file of at most ``max_bytes``; returns a blocking descriptor.

    Opened non-blocking so that a FIFO or device cannot hang the caller, then checked with
    ``fstat`` on the open descriptor, which is race-free.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    if no_follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as e:
        raise _error(kind, name, "no such file", "check the path") from e
    except IsADirectoryError as e:
        raise _error(kind, name, "it is a directory, not a file", "pass the path of a file") from e
    except PermissionError as e:
        if path.is_dir():
            raise _error(kind, name, "it is a directory, not a file",
                         "pass the path of a file") from e
        raise _error(kind, name, "permission denied", "check the file's permissions") from e
    except NotADirectoryError as e:
        raise _error(kind, name, "a parent of the path is not a directory", "check the path") from e
    except OSError as e:
        reason = f"cannot open the file ({e.strerror or e})"
        raise _error(kind, name, reason, "check the path") from e
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _error(kind, name, "it is a directory, not a file", "pass the path of a file")
        if not stat.S_ISREG(st.st_mode):
            raise _error(kind, name, "it is not a regular file",
                         f"pass the path of {_with_article(kind)} file")
        if st.st_size > max_bytes:
            raise _too_big(kind, name, f"the file ({_mb(st.st_size)})", max_bytes)
        if not st.st_size:
            raise _error(kind, name, "the file is empty", "check that it was written completely")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_file(path: Path, *, max_bytes: int, no_follow: bool, kind: str, name: str) -> bytes:
    """Read a regular file of at most ``max_bytes`` (see :func:`_open_regular_file`)."""
    fd = _open_regular_file(path, max_bytes=max_bytes, no_follow=no_follow, kind=kind, name=name)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)  # the file may have grown since fstat
    except OSError as e:
        reason = f"cannot read the file ({e.strerror or e})"
        raise _error(kind, name, reason, "check the file") from e
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise _too_big(kind, name, "the file", max_bytes)
    if not data:
        raise _error(kind, name, "the file is empty", "check that it was written completely")
    return data


class _RedirectRefused(urllib.error.URLError):
    pass


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s) URLs (urllib would also follow ``ftp://``)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in _REMOTE_SCHEMES:
            raise _RedirectRefused(f"the server redirected to {describe_source(newurl)}, "
                                   "which is not an http(s) URL")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _user_agent() -> str:
    try:
        from importlib.metadata import version

        return f"mlxvlm/{version('mlxvlm')}"
    except Exception:  # not installed (running from a checkout)
        return "mlxvlm"


def _fetch_url(url: str, *, timeout: float | None, max_bytes: int, kind: str,
               name: str, public_only: bool = False) -> tuple[bytes, str]:
    """GET ``url``; returns ``(body, content_type)``.

    ``timeout`` bounds each socket operation *and* the whole download, so a server that
    trickles bytes cannot hold the caller for longer than about ``2 * timeout``. At most
    ``max_bytes + 1`` bytes are read, so an oversized body is refused without reading it.
    With ``public_only`` every connection, redirects included, must go to a public
    internet address (see ``mlxvlm.public_net``).
    """
    fix_net = "check the URL and your network, or download the file and pass its path"
    request = urllib.request.Request(url, headers={"User-Agent": _user_agent(), "Accept": "*/*"})
    handlers = public_only_handlers() if public_only else []
    opener = urllib.request.build_opener(_HttpOnlyRedirects, *handlers)
    deadline = None if timeout is None else _clock() + timeout

    def timed_out() -> MediaError:
        after = f" after {timeout:g} s" if timeout else ""
        return _error(kind, name, f"the request timed out{after}",
                      "try again, raise timeout, or download the file and pass its path")

    try:
        response = opener.open(request, timeout=timeout)
    except _RedirectRefused as e:
        raise _error(kind, name, e.reason, "download the file and pass its path") from e
    except urllib.error.HTTPError as e:
        e.close()
        reason = f"the server answered HTTP {e.code}" + (f" {e.reason}" if e.reason else "")
        raise _error(kind, name, reason, "check the URL") from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, (TimeoutError, socket.timeout)):
            raise timed_out() from e
        if isinstance(e.reason, BlockedAddressError):
            raise _error(kind, name, f"refused to connect: {e.reason}",
                         "send the file as a data URL") from e
        raise _error(kind, name, f"could not connect ({e.reason})", fix_net) from e
    except (TimeoutError, socket.timeout) as e:
        raise timed_out() from e
    except (OSError, http.client.HTTPException, ValueError) as e:
        reason = f"the request failed ({e.__class__.__name__}: {e})"
        raise _error(kind, name, reason, fix_net) from e

    with response:
        content_type = response.headers.get("Content-Type", "") or ""
        length = response.headers.get("Content-Length")
        if length and length.strip().isdigit() and int(length) > max_bytes:
            raise _too_big(kind, name, f"the response ({_mb(int(length))})", max_bytes)
        chunks: list[bytes] = []
        total = 0
        try:
            while total <= max_bytes:
                chunk = response.read1(min(_READ_CHUNK, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if deadline is not None and _clock() > deadline and total <= max_bytes:
                    raise timed_out()
        except (TimeoutError, socket.timeout) as e:
            raise timed_out() from e
        except (OSError, http.client.HTTPException) as e:
            raise _error(kind, name, f"the download failed ({e.__class__.__name__}: {e})",
                         fix_net) from e
    if total > max_bytes:
        raise _too_big(kind, name, "the response", max_bytes)
    if not total:
        raise _error(kind, name, "the server sent an empty body", "check the URL")
    return b"".join(chunks), content_type


def _decode_data_url(url: str, *, max_bytes: int, kind: str, name: str) -> bytes:
    """Decode ``data:[<media type>][;base64],<data>`` (RFC 2397)."""
    fix = f"send it as data:{kind}/<format>;base64,<base64 data>"
    header, comma, payload = url.partition(",")
    if not comma:
        raise _error(kind, name, "the data URL has no ',' before its data", fix)
    params = [p.strip() for p in header[5:].split(";")]
    media_type = params[0].lower()
    is_base64 = any(p.lower() == "base64" for p in params[1:])
    if media_type and not (media_type.startswith(f"{kind}/")
                           or media_type == "application/octet-stream"):
        raise _error(kind, name, f"the data URL's media type is {media_type!r}, not {kind}/*", fix)
    if not is_base64:  # percent-encoded: each byte takes 1 to 3 characters
        if len(payload) > 3 * max_bytes:
            raise _too_big(kind, name, f"the data (~{_mb(len(payload) // 3)})", max_bytes)
        data = urllib.parse.unquote_to_bytes(payload)
    else:
        payload = re.sub(r"\s+", "", payload)
        if len(payload) // 4 * 3 > max_bytes + 2:  # refuse before decoding
            raise _too_big(kind, name, f"the data (~{_mb(len(payload) // 4 * 3)})", max_bytes)
        payload += "=" * (-len(payload) % 4)
        try:
            if "-" in payload or "_" in payload:  # the URL-safe alphabet
                data = base64.b64decode(payload, altchars=b"-_", validate=True)
            else:
                data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _error(kind, name, f"the data URL is not valid base64 ({e})", fix) from e
    if len(data) > max_bytes:
        raise _too_big(kind, name, f"the data ({_mb(len(data))})", max_bytes)
    if not data:
        raise _error(kind, name, "the data URL is empty", fix)
    return data


def _read_source_bytes(source: str | os.PathLike | bytes | bytearray | memoryview, *,
                       kind: str, allow_remote: bool, allow_local: bool,
                       allowed_dir: str | os.PathLike | None, timeout: float | None,
                       max_bytes: int, public_only: bool = False,
                       local_reader: Callable[..., Any] | None = None) -> tuple[Any, str]:
    """The encoded bytes of a path, http(s) URL, data URL or bytes source.

    Returns ``(data, hint)``, where ``hint`` is extra context for a decoding error (e.g.
    the Content-Type the server sent). Shared by every media kind. ``local_reader``
    replaces :func:`_read_file` for local paths (same arguments), e.g. to stream a large
    video from disk instead of reading it into memory.
    """
    name = describe_source(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > max_bytes:
            raise _too_big(kind, name, "the data", max_bytes)
        if not data:
            raise _error(kind, name, "the data is empty", f"pass the bytes of a {kind} file")
        return data, ""
    text = os.fsdecode(source)
    if isinstance(source, str):
        if text[:5].lower() == "data:":
            return _decode_data_url(text, max_bytes=max_bytes, kind=kind, name=name), ""
        match = _SCHEME_RE.match(text)
        if match:
            scheme = match.group(1).lower()
            if scheme not in _REMOTE_SCHEMES:
                raise _error(kind, name, f"{scheme}:// URLs are not supported",
                             "use an http(s):// URL, a data URL or a local path")
            if not allow_remote:
                raise _error(kind, name, "fetching remote URLs is disabled",
                             "enable it with allow_remote=True (on the server: its "
                             "allow-remote option), or send the file as a data URL")
            data, content_type = _fetch_url(text, timeout=timeout, max_bytes=max_bytes,
                                            kind=kind, name=name, public_only=public_only)
            hint = f"the server sent Content-Type {content_type!r}" if content_type else ""
            return data, hint
    if not allow_local:
        raise _error(kind, name, "reading local files is disabled",
                     "send the file as a data URL (or an http(s) URL)")
    path = _local_path(text, allowed_dir, kind, name)
    reader = local_reader or _read_file
    return reader(path, max_bytes=max_bytes, no_follow=allowed_dir is not None,
                  kind=kind, name=name), ""


# --------------------------------------------------------------------------- images

# warnings.catch_warnings() swaps process-global state; serialise our own uses of it so
# that concurrent loads (the server's thread pool) cannot leave a filter behind.
_warnings_lock = threading.Lock()


def _check_pixels(width: int, height: int, max_pixels: int, name: str) -> None:
    if width <= 0 or height <= 0:
        raise _error("image", name, f"the image has no pixels ({width}x{height})",
                     "check the image")
    if width * height > max_pixels:
        raise _error(
            "image", name,
            f"the image is {width}x{height} = {width * height:,} pixels, more than the "
            f"limit of {max_pixels:,}",
            "downscale it, or raise max_pixels if you trust the source",
        )


# --------------------------------------------------------------------------- pixel budget
# A server decodes many requests' images at once; each image's own cap does not bound a
# request of twenty of them. While a ``PixelBudget.request()`` is open (in the thread
# preparing a request), every image and video decoded is charged, from its header, before
# its pixels are decoded. Sources that are already pixels (PIL images, arrays) are not.


class PixelBudgetError(MediaError):
    """A request's decoded pixels would pass its budget (``shared`` False) or that of all
    the requests being prepared at once (``shared`` True)."""

    def __init__(self, message: str, *, shared: bool):
        super().__init__(message)
        self.shared = shared


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_pixel_budget() -> tuple[int, int]:
    """(one request, all requests being prepared at once). Preparing an image holds a few
    bytes per decoded pixel at a time (the RGB image, then the processor's copies), so a
    total of physical memory / 64 pixels keeps decoding within a small fraction of memory;
    one request may take a quarter of that."""
    memory = physical_memory() or 8 * 2**30
    total = max(memory // 64, 16_000_000)
    return total // 4, total


class PixelBudget:
    """Decoded pixels per request (``per_request``) and across all open requests
    (``total``); thread-safe."""

    def __init__(self, per_request: int, total: int):
        self.per_request = per_request
        self.total = total
        self.in_use = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def request(self):
        """Charge what is decoded in this block (in this thread) to one request, and give
        it all back at the end."""
        account = _RequestPixels(self)
        token = _active_pixels.set(account)
        try:
            yield account
        finally:
            _active_pixels.reset(token)
            with self._lock:
                self.in_use -= account.used


class _RequestPixels:
    def __init__(self, budget: PixelBudget):
        self.budget = budget
        self.used = 0

    def charge(self, pixels: int, name: str) -> None:
        budget = self.budget
        wanted = self.used + pixels
        if wanted > budget.per_request:
            raise PixelBudgetError(
                f"cannot load {name}: the request's images and video frames need at least "
                f"{wanted:,} decoded pixels, more than the limit of {budget.per_request:,} per "
                "request (the server's --max-request-pixels); send fewer or smaller images",
                shared=False)
        with budget._lock:
            if budget.in_use + pixels > budget.total:
                raise PixelBudgetError(
                    f"cannot load {name}: the server is decoding {budget.in_use:,} pixels for "
                    f"other requests, and this request's {wanted:,} would pass the limit of "
                    f"{budget.total:,} (the server's --max-total-pixels); retry in a moment",
                    shared=True)
            budget.in_use += pixels
        self.used = wanted


_active_pixels: contextvars.ContextVar[_RequestPixels | None] = contextvars.ContextVar(
    "mlxvlm_pixel_budget", default=None)


def _charge_pixels(pixels: int, name: str) -> None:
    account = _active_pixels.get()
    if account is not None:
        account.charge(pixels, name)


def _decode_image(data: bytes, *, max_pixels: int, name: str, hint: str = "") -> Image.Image:
    """Decode encoded image bytes, checking the pixel count before decoding any pixels."""
    try:
        with _warnings_lock, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _error("image", name, f"refused as a possible decompression bomb ({e})",
                     "downscale the image") from e
    except UnidentifiedImageError as e:
        reason = "not a recognised image format"
        if hint:
            reason += f" ({hint})"
        raise _error("image", name, reason,
                     "use PNG, JPEG, WebP, GIF, BMP or TIFF (for video, pass it as a video)") from e
    except Exception as e:  # plugins raise many types on malformed headers
        raise _error("image", name, f"the image header is corrupt ({e.__class__.__name__}: {e})",
                     "check that the file is a complete image") from e
    _check_pixels(image.width, image.height, max_pixels, name)
    _charge_pixels(image.width * image.height, name)
    try:
        image.load()
    except Image.DecompressionBombError as e:
        raise _error("image", name, f"refused as a possible decompression bomb ({e})",
                     "downscale the image") from e
    except Exception as e:
        raise _error("image", name,
                     f"the image data is corrupt or truncated ({e.__class__.__name__}: {e})",
                     "check that the file is a complete image") from e
    return image


def _exif_transpose(image: Image.Image, name: str) -> Image.Image:
    """A new image with the EXIF orientation applied (malformed EXIF is ignored)."""
    try:
        return ImageOps.exif_transpose(image)  # a copy when there is nothing to do
    except Exception as e:
        logger.warning("ignoring unreadable EXIF orientation of image %s: %s", name, e)
        return image.copy()


def _to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB; transparent pixels are composited over white.

    An RGB image without transparency is returned as is, so pass one the caller owns.
    """
    if image.mode.startswith("I;16"):
        # Pillow's conversion clips 16-bit values at 255; scale them instead.
        pixels = np.asarray(image).astype(np.uint16, copy=False)
        image = Image.fromarray((pixels >> 8).astype(np.uint8))
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        return background.convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def _image_from_array(array: np.ndarray, *, max_pixels: int, name: str) -> Image.Image:
    fix = "pass a uint8 array of shape (H, W), (H, W, 3) or (H, W, 4)"
    if array.dtype != np.uint8:
        raise _error("image", name, f"the array has dtype {array.dtype}, not uint8", fix)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
        raise _error("image", name, f"the array has shape {tuple(array.shape)}", fix)
    _check_pixels(array.shape[1], array.shape[0], max_pixels, name)
    # This shares the caller's buffer; load_image's _exif_transpose makes the copy.
    return Image.fromarray(np.ascontiguousarray(array))


def load_image(
    source: ImageSource,
    *,
    allow_remote: bool = True,
    allowed_dir: str | os.PathLike | None = None,
    allow_local: bool = True,
    timeout: float | None = DEFAULT_TIMEOUT,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    public_only: bool = False,
) -> Image.Image:
    """Load an image as an RGB ``PIL.Image.Image``, upright and without transparency.

    ``source`` is one of: a PIL image; a local path (``str`` or ``os.PathLike``, ``~`` is
    expanded); an ``http(s)://`` URL; a ``data:image/...;base64,...`` URL; the encoded
    bytes of an image file; or a ``uint8`` numpy array of shape (H, W), (H, W, 3) or
    (H, W, 4).

    - ``allow_remote``: if False, http(s) URLs are refused.
    - ``allowed_dir``: if given, local paths must resolve, after following symlinks,
      inside this directory (the server sets it); None allows any local path.
    - ``allow_local``: if False, local paths are refused whatever ``allowed_dir`` says
      (for a server that must not read local files at all).
    - ``timeout``: seconds for each network operation and for the whole download.
    - ``max_bytes``: the largest encoded input accepted (file, body or data URL).
    - ``max_pixels``: the largest ``width * height`` accepted, checked from the image
      header before any pixels are decoded. Pillow's own limit
      (``PIL.Image.MAX_IMAGE_PIXELS``) applies as well.
    - ``public_only``: URLs may only lead (redirects included) to public internet
      addresses, checked after DNS resolution and before connecting; private, loopback
      and link-local targets are refused (the server sets it).

    The EXIF orientation is applied, pixels with alpha are composited over white, and an
    animated image gives its first frame. The caller's image or array is never modified
    or shared. Every failure raises
    :class:`MediaError`.
    """
    name = describe_source(source)
    if isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, max_pixels, name)
        try:
            source.load()
        except Exception as e:
            raise _error("image", name, f"the image data is corrupt or truncated ({e})",
                         "check that the file is a complete image") from e
        image = source
    elif isinstance(source, np.ndarray):
        image = _image_from_array(source, max_pixels=max_pixels, name=name)
    elif isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        data, hint = _read_source_bytes(
            source, kind="image", allow_remote=allow_remote, allow_local=allow_local,
            allowed_dir=allowed_dir, timeout=timeout, max_bytes=max_bytes,
            public_only=public_only,
        )
        image = _decode_image(data, max_pixels=max_pixels, name=name, hint=hint)
    else:
        raise _error(
            "image", name, f"unsupported source type {type(source).__name__}",
            "pass a path, an http(s) or data URL, bytes, a PIL image or a numpy array",
        )
    # _exif_transpose returns a new image, so the caller's is never returned or changed.
    return _to_rgb(_exif_transpose(image, name))


def load_images(sources: Iterable[ImageSource], **kwargs: Any) -> list[Image.Image]:
    """:func:`load_image` on each of ``sources``; takes the same keyword arguments.

    A failure names the position of the bad source, e.g. ``sources[2]: cannot load ...``.
    """
    if isinstance(sources, (str, bytes, bytearray, memoryview, os.PathLike, Image.Image,
                            np.ndarray)):
        raise TypeError("load_images expects a list of sources; use load_image for one source")
    images = []
    for i, source in enumerate(sources):
        try:
            images.append(load_image(source, **kwargs))
        except MediaError as e:
            raise MediaError(f"sources[{i}]: {e}") from e
    return images


# --------------------------------------------------------------------------- video and audio

DEFAULT_FPS = 2.0
# Qwen's reference utilities (qwen-vl-utils) sample at most 768 frames.
DEFAULT_MAX_FRAMES = 768
# All sampled frames of one video together, as decoded: what qwen-vl-utils allows a whole
# video (90% of 128k tokens of 28 x 28 pixels), about 270 MB of RGB. Larger videos are
# downscaled while decoding, so a long or 4K video cannot exhaust memory.
DEFAULT_MAX_VIDEO_PIXELS = int(128_000 * 28 * 28 * 0.9)
# Local files are streamed from disk; URLs, data URLs and bytes are held in memory.
DEFAULT_MAX_VIDEO_BYTES = 2**30
DEFAULT_MAX_AUDIO_BYTES = 256 * 2**20
DEFAULT_MAX_AUDIO_SECONDS = 3600.0
# Every audio model mlxvlm supports listens at 16 kHz (Whisper's rate); a video's sound
# track is decoded at this rate unless told otherwise.
DEFAULT_AUDIO_RATE = 16_000

# The options that say where media may come from (the rest are per kind).
ACCESS_OPTIONS = ("allow_remote", "allowed_dir", "allow_local", "timeout", "public_only")

_VIDEO_FIX = "use a common video format (MP4, WebM, MKV, MOV, AVI)"
_AUDIO_FIX = "use a common audio format (WAV, MP3, FLAC, OGG, M4A) or a video with sound"


@dataclass
class Audio:
    """Mono float32 samples in [-1, 1] at ``sampling_rate`` Hz."""

    samples: np.ndarray  # (N,) float32
    sampling_rate: int
    name: str = "<audio>"
    source_rate: int | None = None
    source_channels: int | None = None
    note: str = ""  # e.g. that a video's sound track was cut at the length limit

    @property
    def duration(self) -> float:
        return self.samples.shape[0] / self.sampling_rate

    def resampled(self, sampling_rate: int) -> "Audio":
        """This audio at another rate (itself when the rate is already right)."""
        if sampling_rate == self.sampling_rate:
            return self
        samples = resample_audio(self.samples, self.sampling_rate, sampling_rate, name=self.name)
        return replace(self, samples=samples, sampling_rate=sampling_rate)

    def describe(self) -> str:
        source = ""
        channels = self.source_channels or 1
        if self.source_rate and (self.source_rate != self.sampling_rate or channels != 1):
            mixed = f", {channels} channels" if channels != 1 else ""
            source = f" (from {self.source_rate} Hz{mixed})"
        note = f"; {self.note}" if self.note else ""
        return (f"audio {self.name}: {self.duration:.2f} s, mono {self.sampling_rate} Hz"
                f"{source}{note}")


@dataclass
class Video:
    """Frames sampled from a video, and what the sampling was.

    ``frame_indices`` are positions in the source's ``total_frames`` frames at
    ``source_fps``; the frames stand for the video at ``sampled_fps`` frames per second.
    """

    frames: np.ndarray  # (T, H, W, 3) uint8 RGB
    frame_indices: np.ndarray  # (T,) int
    timestamps: np.ndarray  # (T,) seconds
    sampled_fps: float
    total_frames: int
    source_fps: float
    source_size: tuple[int, int]  # (width, height) before any downscaling
    name: str = "<video>"
    audio: Audio | None = None
    note: str = ""  # e.g. that the frames were downscaled to fit the pixel budget

    @property
    def duration(self) -> float:
        return self.total_frames / self.source_fps

    def describe(self) -> str:
        t, h, w, _ = self.frames.shape
        text = (f"video {self.name}: {self.duration:.2f} s at {self.source_fps:g} fps, "
                f"{t} of {self.total_frames} frames sampled ({self.sampled_fps:.3g} per "
                f"second), {w}x{h}")
        if self.note:
            text += f" ({self.note})"
        if self.audio is not None:
            text += f"; sound track {self.audio.duration:.2f} s"
            if self.audio.note:
                text += f" ({self.audio.note})"
        return text


def sample_frame_indices(total_frames: int, source_fps: float, fps: float,
                         max_frames: int) -> np.ndarray:
    """Indices of frames spread evenly over the video, ``fps`` per second of video (at
    least one, at most ``max_frames``), as qwen-vl-utils and transformers sample."""
    wanted = total_frames / source_fps * fps
    count = int(min(max(round(wanted), 1), max_frames, total_frames))
    return np.unique(np.linspace(0, total_frames - 1, count).round().astype(np.int64))


def fit_pixel_budget(width: int, height: int, frames: int, max_pixels: int) -> tuple[int, int]:
    """The frame size (same aspect ratio) at which ``frames`` frames hold at most
    ``max_pixels`` pixels together; the size itself when they already do."""
    if frames * width * height <= max_pixels:
        return width, height
    scale = (max_pixels / (frames * width * height)) ** 0.5
    return max(1, int(width * scale)), max(1, int(height * scale))


def _downscale_note(width: int, height: int, out_w: int, out_h: int, max_pixels: int) -> str:
    if (out_w, out_h) == (width, height):
        return ""
    return (f"downscaled from {width}x{height} to fit the budget of {max_pixels:,} pixels "
            "per video")


def _check_options(kind: str, name: str, **positive: float) -> None:
    for option, value in positive.items():
        if not value > 0:
            raise _error(kind, name, f"{option} must be positive, got {value!r}",
                         f"pass a positive {option}")


# ---- decoding containers with PyAV


def _open_stream(path: Path, *, max_bytes: int, no_follow: bool, kind: str, name: str):
    """A local file opened for PyAV to read as it goes (large videos stay on disk)."""
    fd = _open_regular_file(path, max_bytes=max_bytes, no_follow=no_follow, kind=kind, name=name)
    return os.fdopen(fd, "rb")


def _media_file(source, *, kind: str, access: dict, max_bytes: int):
    """A seekable binary file over the source's encoded bytes, and a decoding hint."""
    data, hint = _read_source_bytes(source, kind=kind, max_bytes=max_bytes,
                                    local_reader=_open_stream, **access)
    return (io.BytesIO(data) if isinstance(data, bytes) else data), hint


def _open_container(file, *, kind: str, name: str, hint: str):
    import av

    file.seek(0)
    fix = _VIDEO_FIX if kind == "video" else _AUDIO_FIX
    try:
        # Every source reaches FFmpeg as an open file; whitelisting no protocol stops a
        # container (a playlist, a reference movie) from making FFmpeg open other files
        # or URLs behind the caller's access policy.
        container = av.open(file, mode="r", options={"protocol_whitelist": "none"})
    except av.FFmpegError as e:
        reason = f"not a recognised {kind} format, or the file is truncated or corrupt"
        if hint:
            reason += f" ({hint})"
        raise _error(kind, name, reason, fix) from e
    except Exception as e:  # PyAV raises others on some malformed headers
        raise _error(kind, name, f"the header is corrupt ({e.__class__.__name__}: {e})",
                     fix) from e
    if container.format.name.endswith("_pipe") or container.format.name == "image2":
        container.close()
        raise _error(kind, name, f"it is an image ({container.format.name}), not a {kind}",
                     f"pass it as an image, or {fix}")
    return container


def _decode_error(kind: str, name: str, e: Exception) -> MediaError:
    return _error(kind, name, f"the {kind} data is corrupt or truncated "
                  f"({e.__class__.__name__}: {e})", f"check that the file is a complete {kind}")


class _AudioCollector:
    """Decoded audio frames -> one mono float32 track at ``rate`` Hz, at most
    ``max_seconds`` long (``strict``: longer is an error, else the rest is dropped)."""

    def __init__(self, stream, rate: int | None, max_seconds: float, name: str, strict: bool):
        self.rate = rate or stream.rate
        self.source_rate, self.source_channels = stream.rate, stream.channels
        self.limit = int(max_seconds * self.rate)
        self.name, self.strict = name, strict
        self.resampler = None
        self.chunks: list[np.ndarray] = []
        self.length = 0
        self.cut = False

    def add(self, frame) -> None:
        import av

        if self.cut:
            return
        if self.resampler is None:
            # Same channels, float planar, target rate; mono is the mean of the channels.
            self.resampler = av.AudioResampler(format="fltp", layout=frame.layout.name,
                                               rate=self.rate)
        for out in self.resampler.resample(frame):
            self._keep(out.to_ndarray().mean(axis=0, dtype=np.float32))

    def flush(self) -> None:
        if self.resampler is not None and not self.cut:
            for out in self.resampler.resample(None):
                self._keep(out.to_ndarray().mean(axis=0, dtype=np.float32))

    def _keep(self, samples: np.ndarray) -> None:
        if self.length + samples.shape[0] > self.limit:
            if self.strict:
                raise _error("audio", self.name,
                             f"it is longer than the limit of {self.limit / self.rate:g} s",
                             "cut it shorter, or raise max_seconds")
            samples = samples[: self.limit - self.length]
            self.cut = True
        self.chunks.append(samples)
        self.length += samples.shape[0]

    def audio(self) -> Audio:
        samples = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        note = f"cut at the limit of {self.limit / self.rate:g} s" if self.cut else ""
        return Audio(samples.astype(np.float32, copy=False), self.rate, self.name,
                     self.source_rate, self.source_channels, note)


def _count_frames(file, *, name: str, hint: str) -> int:
    """Frames of a video stream whose container does not say (WebM, some MKV): its
    non-empty packets, counted without decoding."""
    import av

    with _open_container(file, kind="video", name=name, hint=hint) as container:
        stream = container.streams.video[0]
        try:
            return sum(1 for packet in container.demux(stream) if packet.size)
        except av.FFmpegError as e:
            raise _decode_error("video", name, e) from e


def _decode_video(file, *, name: str, hint: str, fps: float, max_frames: int, max_pixels: int,
                  max_frame_pixels: int, audio_rate: int | None, with_audio: bool,
                  max_audio_seconds: float) -> Video:
    import av

    with _open_container(file, kind="video", name=name, hint=hint) as container:
        if not container.streams.video:
            raise _error("video", name, "the file has no video stream",
                         "pass it as audio if it is a sound file, or " + _VIDEO_FIX)
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise _error("video", name, f"the video has no pixels ({width}x{height})", _VIDEO_FIX)
        if width * height > max_frame_pixels:
            raise _error("video", name,
                         f"its frames are {width}x{height} = {width * height:,} pixels, more "
                         f"than the limit of {max_frame_pixels:,}",
                         "downscale it, or raise max_frame_pixels if you trust the source")
        source_fps = float(stream.average_rate or stream.guessed_rate or 0)
        total = stream.frames
        has_audio = with_audio and bool(container.streams.audio)
    if source_fps <= 0:
        raise _error("video", name, "the container does not say its frame rate", _VIDEO_FIX)
    if total <= 0:
        total = _count_frames(file, name=name, hint=hint)
    if total <= 0:
        raise _error("video", name, "the video has no frames", "check the file")

    wanted = sample_frame_indices(total, source_fps, fps, max_frames)
    out_w, out_h = fit_pixel_budget(width, height, len(wanted), max_pixels)
    _charge_pixels(len(wanted) * out_w * out_h, name)
    frames, indices, times = [], [], []
    collector = None
    with _open_container(file, kind="video", name=name, hint=hint) as container:
        video = container.streams.video[0]
        video.thread_type = "AUTO"
        streams = [video]
        if has_audio:
            streams.append(container.streams.audio[0])
            collector = _AudioCollector(streams[1], audio_rate, max_audio_seconds, name,
                                        strict=False)
        next_index, position = 0, 0
        try:
            for packet in container.demux(*streams):
                for frame in packet.decode():
                    if packet.stream.type == "audio":
                        collector.add(frame)
                        continue
                    if next_index < len(wanted) and position == wanted[next_index]:
                        frames.append(frame.to_ndarray(format="rgb24", width=out_w,
                                                       height=out_h, interpolation="AREA"))
                        indices.append(position)
                        times.append(frame.time if frame.time is not None
                                     else position / source_fps)
                        next_index += 1
                    position += 1
                if next_index == len(wanted) and collector is None:
                    break
            if collector is not None:
                collector.flush()
        except av.FFmpegError as e:
            raise _decode_error("video", name, e) from e
    if not frames:
        raise _error("video", name, "no frame could be decoded", "check that the file is a "
                     "complete video")
    note = _downscale_note(width, height, out_w, out_h, max_pixels)
    audio = collector.audio() if collector is not None and collector.length else None
    return Video(
        frames=np.stack(frames), frame_indices=np.array(indices), timestamps=np.array(times),
        sampled_fps=len(frames) / (total / source_fps), total_frames=total,
        source_fps=source_fps, source_size=(width, height), name=name, audio=audio, note=note,
    )


def _video_from_frames(frames: Any, *, name: str, fps: float, max_pixels: int,
                       max_frame_pixels: int, access: dict) -> Video:
    """Frames given directly (an array or a list of images): taken as they are, as a video
    at ``fps`` frames per second, downscaled only to fit ``max_pixels``. Frames named by
    path or URL are read under the same ``access`` policy as any source."""
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise _error("video", name, f"the array has shape {tuple(frames.shape)} and dtype "
                         f"{frames.dtype}", "pass uint8 frames of shape (T, H, W, 3)")
        frames = list(frames)
    if not frames:
        raise _error("video", name, "the list of frames is empty", "pass at least one frame")
    images = []
    for i, frame in enumerate(frames):
        try:
            images.append(load_image(frame, max_pixels=max_frame_pixels, **access))
        except MediaError as e:
            raise _error("video", name, f"frame {i}: {e}") from e
    sizes = {image.size for image in images}
    if len(sizes) > 1:
        raise _error("video", name, f"the frames differ in size ({sorted(sizes)})",
                     "pass frames of one size")
    width, height = images[0].size
    out_w, out_h = fit_pixel_budget(width, height, len(images), max_pixels)
    if (out_w, out_h) != (width, height):
        images = [image.resize((out_w, out_h), Image.Resampling.BOX) for image in images]
    note = _downscale_note(width, height, out_w, out_h, max_pixels)
    count = len(images)
    return Video(
        frames=np.stack([np.asarray(image) for image in images]),
        frame_indices=np.arange(count), timestamps=np.arange(count) / fps, sampled_fps=fps,
        total_frames=count, source_fps=fps, source_size=(width, height), name=name, note=note,
    )


def load_video(
    source: Any,
    *,
    fps: float = DEFAULT_FPS,
    max_frames: int = DEFAULT_MAX_FRAMES,
    max_pixels: int = DEFAULT_MAX_VIDEO_PIXELS,
    max_frame_pixels: int = DEFAULT_MAX_PIXELS,
    with_audio: bool = True,
    audio_rate: int | None = DEFAULT_AUDIO_RATE,
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    allow_remote: bool = True,
    allowed_dir: str | os.PathLike | None = None,
    allow_local: bool = True,
    timeout: float | None = DEFAULT_TIMEOUT,
    max_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
    public_only: bool = False,
) -> Video:
    """Decode a video with PyAV and sample its frames.

    ``source`` is a local path, an ``http(s)://`` URL, a ``data:video/...;base64,...`` URL,
    the bytes of a video file, a :class:`Video` (returned as is), or frames given directly:
    a uint8 array of shape (T, H, W, 3) or a list of images (anything :func:`load_image`
    takes), which are used as they are, as a video at ``fps`` frames per second.

    - ``fps``: frames sampled per second of video, spread evenly; at least one frame and
      at most ``max_frames``.
    - ``max_pixels``: the budget of all sampled frames together; frames are downscaled
      while decoding to fit it (``Video.note`` says so).
    - ``max_frame_pixels``: the largest frame size accepted from the header, before
      decoding anything.
    - ``with_audio``: also decode the first sound track, mono at ``audio_rate`` Hz (None:
      its own rate), into ``Video.audio``; a track longer than ``max_audio_seconds`` is cut.
    - ``allow_remote``, ``allowed_dir``, ``allow_local``, ``timeout``, ``max_bytes``,
      ``public_only``: as for :func:`load_image` (a local file is read from disk as it is
      decoded; other sources are held in memory).

    Every failure (a missing or unreadable file, an unknown format, no video stream, no
    decodable frame, corrupt data, limits) raises :class:`MediaError` naming the source.
    """
    name = describe_source(source)
    if isinstance(source, Video):
        return source
    _check_options("video", name, fps=fps, max_frames=max_frames, max_pixels=max_pixels)
    access = dict(allow_remote=allow_remote, allowed_dir=allowed_dir, allow_local=allow_local,
                  timeout=timeout, public_only=public_only)
    if isinstance(source, (np.ndarray, list, tuple)):
        return _video_from_frames(source, name=name, fps=fps, max_pixels=max_pixels,
                                  max_frame_pixels=max_frame_pixels, access=access)
    if not isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        raise _error("video", name, f"unsupported source type {type(source).__name__}",
                     "pass a path, an http(s) or data URL, bytes, a (T, H, W, 3) uint8 array "
                     "or a list of frames")
    file, hint = _media_file(source, kind="video", access=access, max_bytes=max_bytes)
    with file:
        return _decode_video(file, name=name, hint=hint, fps=fps, max_frames=int(max_frames),
                             max_pixels=max_pixels, max_frame_pixels=max_frame_pixels,
                             audio_rate=audio_rate, with_audio=with_audio,
                             max_audio_seconds=max_audio_seconds)


def _decode_audio(file, *, name: str, hint: str, sampling_rate: int | None,
                  max_seconds: float) -> Audio:
    import av

    with _open_container(file, kind="audio", name=name, hint=hint) as container:
        if not container.streams.audio:
            raise _error("audio", name, "the file has no audio stream", _AUDIO_FIX)
        stream = container.streams.audio[0]
        collector = _AudioCollector(stream, sampling_rate, max_seconds, name, strict=True)
        try:
            for frame in container.decode(stream):
                collector.add(frame)
            collector.flush()
        except av.FFmpegError as e:
            raise _decode_error("audio", name, e) from e
    if not collector.length:
        raise _error("audio", name, "it holds no sound (0 samples)", "check the file")
    return collector.audio()


def resample_audio(samples: np.ndarray, from_rate: int, to_rate: int, *,
                   name: str = "<audio>") -> np.ndarray:
    """Mono float32 ``samples`` from ``from_rate`` to ``to_rate`` Hz (FFmpeg's resampler,
    as when decoding)."""
    import av

    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if from_rate == to_rate:
        return samples
    resampler = av.AudioResampler(format="flt", layout="mono", rate=to_rate)
    pieces = []
    step = from_rate * 10  # ten seconds per frame
    try:
        for start in range(0, samples.shape[0], step):
            frame = av.AudioFrame.from_ndarray(samples[None, start : start + step],
                                               format="flt", layout="mono")
            frame.sample_rate = from_rate
            pieces.extend(out.to_ndarray()[0] for out in resampler.resample(frame))
        pieces.extend(out.to_ndarray()[0] for out in resampler.resample(None))
    except av.FFmpegError as e:
        raise _error("audio", name, f"cannot resample it from {from_rate} to {to_rate} Hz "
                     f"({e})") from e
    return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)


def _audio_from_array(samples: np.ndarray, rate: int | None, *, name: str,
                      max_seconds: float) -> Audio:
    fix = "pass a 1-D float array of mono samples in [-1, 1] with its sampling_rate"
    if rate is None:
        raise _error("audio", name, "an array of samples needs its sampling rate", fix)
    if samples.ndim != 1 or not np.issubdtype(samples.dtype, np.floating):
        raise _error("audio", name, f"the array has shape {tuple(samples.shape)} and dtype "
                     f"{samples.dtype}", fix)
    if not samples.size:
        raise _error("audio", name, "the array is empty", fix)
    if samples.size > max_seconds * rate:
        raise _error("audio", name, f"it is longer than the limit of {max_seconds:g} s",
                     "cut it shorter, or raise max_seconds")
    if not np.isfinite(samples).all():
        raise _error("audio", name, "the samples contain NaN or infinity", fix)
    return Audio(samples.astype(np.float32), int(rate), name, int(rate), 1)


def load_audio(
    source: Any,
    *,
    sampling_rate: int | None = None,
    max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    allow_remote: bool = True,
    allowed_dir: str | os.PathLike | None = None,
    allow_local: bool = True,
    timeout: float | None = DEFAULT_TIMEOUT,
    max_bytes: int = DEFAULT_MAX_AUDIO_BYTES,
    public_only: bool = False,
) -> Audio:
    """Decode audio with PyAV as mono float32 at ``sampling_rate`` Hz (None: its own rate).

    ``source`` is a local path, an ``http(s)://`` URL, a ``data:audio/...;base64,...`` URL,
    the bytes of a file (any container PyAV reads, videos included: their first sound
    track), an :class:`Audio` (resampled if needed), or samples given directly: a 1-D float
    array at ``sampling_rate`` Hz, or a ``(samples, rate)`` pair. Several channels are
    mixed down to their mean. Longer than ``max_seconds`` is an error; the access options
    and ``max_bytes`` are :func:`load_image`'s. Every failure raises :class:`MediaError`.
    """
    name = describe_source(source)
    _check_options("audio", name, max_seconds=max_seconds)
    if sampling_rate is not None:
        _check_options("audio", name, sampling_rate=sampling_rate)
    if isinstance(source, Audio):
        audio = source
    elif isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], np.ndarray):
        audio = _audio_from_array(source[0], source[1], name=name, max_seconds=max_seconds)
    elif isinstance(source, np.ndarray):
        audio = _audio_from_array(source, sampling_rate, name=name, max_seconds=max_seconds)
    elif isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        access = dict(allow_remote=allow_remote, allowed_dir=allowed_dir,
                      allow_local=allow_local, timeout=timeout, public_only=public_only)
        file, hint = _media_file(source, kind="audio", access=access, max_bytes=max_bytes)
        with file:
            return _decode_audio(file, name=name, hint=hint, sampling_rate=sampling_rate,
                                 max_seconds=max_seconds)
    else:
        raise _error("audio", name, f"unsupported source type {type(source).__name__}",
                     "pass a path, an http(s) or data URL, bytes, or a float array with its "
                     "sampling rate")
    return audio if sampling_rate is None else audio.resampled(sampling_rate)
