"""Loading media (images now; video frames and audio via PyAV later) from user input.

Every loader takes the same kinds of *source* and the same limits, and every failure is a
one-line :class:`MediaError` that names the input (shortened), says what was wrong and
what to do about it.

The module is layered so that video and audio can reuse the lower half:

1. naming and errors     -- :class:`MediaError`, :func:`describe_source`, :func:`_error`
2. getting the bytes     -- :func:`_local_path` (``allowed_dir`` policy), :func:`_read_file`,
                            :func:`_fetch_url`, :func:`_decode_data_url`, and
                            :func:`_read_source_bytes` which dispatches on the source kind
3. decoding              -- images: :func:`_decode_image`, :func:`_to_rgb`, :func:`load_image`

Decoding untrusted input is the risky part, so the limits are enforced as early as
possible: ``max_bytes`` before a body is read in full (Content-Length, file size, base64
length) and ``max_pixels`` from the image header, before any pixel data is decoded.
"""

from __future__ import annotations

import base64
import binascii
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
from pathlib import Path
from typing import Any, Iterable, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mlxvlm.errors import MlxvlmError
from mlxvlm.public_net import BlockedAddressError, public_only_handlers

__all__ = ["MediaError", "ImageSource", "load_image", "load_images", "describe_source"]

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


def _read_file(path: Path, *, max_bytes: int, no_follow: bool, kind: str, name: str) -> bytes:
    """Read a regular file of at most ``max_bytes``.

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
            raise _error(kind, name, "it is not a regular file", "pass the path of an image file")
        if st.st_size > max_bytes:
            raise _too_big(kind, name, f"the file ({_mb(st.st_size)})", max_bytes)
        os.set_blocking(fd, True)
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
                       max_bytes: int, public_only: bool = False) -> tuple[bytes, str]:
    """The encoded bytes of a path, http(s) URL, data URL or bytes source.

    Returns ``(data, hint)``, where ``hint`` is extra context for a decoding error (e.g.
    the Content-Type the server sent). Shared by every media kind.
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
    return _read_file(path, max_bytes=max_bytes, no_follow=allowed_dir is not None,
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
