"""Getting a source's encoded bytes under a :class:`~mlxvlm.media.policy.MediaPolicy`:
a local path (``allowed_dir`` checked on the resolved path, the file opened without
following a final symlink), an http(s) URL (redirects only to http(s), public addresses
only when the policy says so, a deadline on the whole download) or a data URL.

``max_bytes`` is enforced before a body is read in full: from the file size,
Content-Length or base64 length.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import os
import socket
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

from mlxvlm.media.errors import (
    SCHEME_RE,
    MediaError,
    describe_source,
    error,
    mb,
    too_big,
    with_article,
)
from mlxvlm.media.policy import MediaPolicy
from mlxvlm.media.public_net import BlockedAddressError, public_only_handlers

_READ_CHUNK = 1 << 16
_REMOTE_SCHEMES = ("http", "https")
_clock = time.monotonic  # a seam for tests of the download deadline
# Kinds whose data URLs are not <kind>/<format>: their media types.
_DATA_URL_TYPES = {"PDF": ("application/pdf", "application/x-pdf")}


def _local_path(source: str | os.PathLike, policy: MediaPolicy, kind: str, name: str) -> Path:
    """The path to open for a local ``source``, enforcing ``allowed_dir``.

    With ``allowed_dir`` the path is resolved (following every symlink) and must lie
    inside the resolved ``allowed_dir``; the check comes before any existence check so
    that it does not reveal which files exist elsewhere. The resolved path is returned,
    and :func:`_read_file` opens it without following a final symlink, so the file read
    is the one checked.
    """
    text = os.fspath(source)
    if not text:
        raise error(kind, name, "the path is empty", "pass a file path, URL or data URL")
    if "\0" in text:
        raise error(kind, name, "the path contains a NUL character", "check the path")
    path = Path(text).expanduser()
    if policy.allowed_dir is None:
        return path
    root = Path(policy.allowed_dir).expanduser().resolve()
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as e:  # symlink loops
        raise error(kind, name, f"cannot resolve the path ({e.__class__.__name__})",
                    "check the path") from e
    if not resolved.is_relative_to(root):
        raise error(
            kind, name, f"the path is outside the allowed directory {str(root)!r}",
            f"put the file inside that directory, or {policy.other_ways(besides='local')}",
        )
    return resolved


def open_regular_file(path: Path, *, max_bytes: int, no_follow: bool, kind: str,
                      name: str, raise_it: str = "") -> int:
    """Open a regular file of at most ``max_bytes``; returns a blocking descriptor.

    Opened non-blocking so that a FIFO or device cannot hang the caller, then checked with
    ``fstat`` on the open descriptor, which is race-free. ``raise_it``: the end of the
    fix for a file too large (``OptionNames.raise_fix``).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    if no_follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as e:
        raise error(kind, name, "no such file", "check the path") from e
    except IsADirectoryError as e:
        raise error(kind, name, "it is a directory, not a file", "pass the path of a file") from e
    except PermissionError as e:
        if path.is_dir():
            raise error(kind, name, "it is a directory, not a file",
                        "pass the path of a file") from e
        raise error(kind, name, "permission denied", "check the file's permissions") from e
    except NotADirectoryError as e:
        raise error(kind, name, "a parent of the path is not a directory", "check the path") from e
    except OSError as e:
        reason = f"cannot open the file ({e.strerror or e})"
        raise error(kind, name, reason, "check the path") from e
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise error(kind, name, "it is a directory, not a file", "pass the path of a file")
        if not stat.S_ISREG(st.st_mode):
            raise error(kind, name, "it is not a regular file",
                        f"pass the path of {with_article(kind)} file")
        if st.st_size > max_bytes:
            raise too_big(kind, name, f"the file ({mb(st.st_size)})", max_bytes, raise_it)
        if not st.st_size:
            raise error(kind, name, "the file is empty", "check that it was written completely")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_file(path: Path, *, max_bytes: int, no_follow: bool, kind: str, name: str,
               raise_it: str = "") -> bytes:
    """Read a regular file of at most ``max_bytes`` (see :func:`open_regular_file`)."""
    fd = open_regular_file(path, max_bytes=max_bytes, no_follow=no_follow, kind=kind, name=name,
                           raise_it=raise_it)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)  # the file may have grown since fstat
    except OSError as e:
        reason = f"cannot read the file ({e.strerror or e})"
        raise error(kind, name, reason, "check the file") from e
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise too_big(kind, name, "the file", max_bytes, raise_it)
    if not data:
        raise error(kind, name, "the file is empty", "check that it was written completely")
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


def _fetch_url(url: str, *, policy: MediaPolicy, max_bytes: int, kind: str,
               name: str, raise_it: str = "") -> tuple[bytes, str]:
    """GET ``url``; returns ``(body, content_type)``.

    The policy's ``timeout`` bounds each socket operation *and* the whole download, so a
    server that trickles bytes cannot hold the caller for longer than about ``2 *
    timeout``. At most ``max_bytes + 1`` bytes are read, so an oversized body is refused
    without reading it. With ``public_only`` every connection, redirects included, must
    go to a public internet address (see ``mlxvlm.media.public_net``).
    """
    timeout, public_only = policy.timeout, policy.public_only
    instead = policy.other_ways(besides="remote")
    fix_net = f"check the URL and your network, or {instead}"
    request = urllib.request.Request(url, headers={"User-Agent": _user_agent(), "Accept": "*/*"})
    handlers = public_only_handlers() if public_only else []
    opener = urllib.request.build_opener(_HttpOnlyRedirects, *handlers)
    deadline = None if timeout is None else _clock() + timeout

    def timed_out() -> MediaError:
        after = f" after {timeout:g} s" if timeout else ""
        option = policy.names.timeout
        raise_it = f", raise {option}" if option else ""
        return error(kind, name, f"the request timed out{after}",
                     f"try again{raise_it}, or {instead}")

    try:
        response = opener.open(request, timeout=timeout)
    except _RedirectRefused as e:
        raise error(kind, name, e.reason, instead) from e
    except urllib.error.HTTPError as e:
        e.close()
        reason = f"the server answered HTTP {e.code}" + (f" {e.reason}" if e.reason else "")
        raise error(kind, name, reason, "check the URL") from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, (TimeoutError, socket.timeout)):
            raise timed_out() from e
        if isinstance(e.reason, BlockedAddressError):
            raise error(kind, name, f"refused to connect: {e.reason}", instead) from e
        raise error(kind, name, f"could not connect ({e.reason})", fix_net) from e
    except (TimeoutError, socket.timeout) as e:
        raise timed_out() from e
    except (OSError, http.client.HTTPException, ValueError) as e:
        reason = f"the request failed ({e.__class__.__name__}: {e})"
        raise error(kind, name, reason, fix_net) from e

    with response:
        content_type = response.headers.get("Content-Type", "") or ""
        length = response.headers.get("Content-Length")
        if length and length.strip().isdigit() and int(length) > max_bytes:
            raise too_big(kind, name, f"the response ({mb(int(length))})", max_bytes,
                          raise_it)
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
            raise error(kind, name, f"the download failed ({e.__class__.__name__}: {e})",
                        fix_net) from e
    if total > max_bytes:
        raise too_big(kind, name, "the response", max_bytes, raise_it)
    if not total:
        raise error(kind, name, "the server sent an empty body", "check the URL")
    return b"".join(chunks), content_type


def _decode_data_url(url: str, *, max_bytes: int, kind: str, name: str,
                     raise_it: str = "") -> bytes:
    """Decode ``data:[<media type>][;base64],<data>`` (RFC 2397)."""
    types = _DATA_URL_TYPES.get(kind)
    wanted = types[0] if types else f"{kind}/<format>"
    fix = f"send it as data:{wanted};base64,<base64 data>"
    header, comma, payload = url.partition(",")
    if not comma:
        raise error(kind, name, "the data URL has no ',' before its data", fix)
    params = [p.strip() for p in header[5:].split(";")]
    media_type = params[0].lower()
    is_base64 = any(p.lower() == "base64" for p in params[1:])
    fits = media_type in types if types else media_type.startswith(f"{kind}/")
    if media_type and not (fits or media_type == "application/octet-stream"):
        what = types[0] if types else f"{kind}/*"
        raise error(kind, name, f"the data URL's media type is {media_type!r}, not {what}", fix)
    if not is_base64:  # percent-encoded: each byte takes 1 to 3 characters
        if len(payload) > 3 * max_bytes:
            raise too_big(kind, name, f"the data (~{mb(len(payload) // 3)})", max_bytes, raise_it)
        data = urllib.parse.unquote_to_bytes(payload)
    else:
        # Line breaks and spaces are allowed in base64 (str.split: 30x faster than a regex
        # on a 20 MiB payload, and it runs holding the GIL).
        payload = "".join(payload.split())
        if len(payload) // 4 * 3 > max_bytes + 2:  # refuse before decoding
            raise too_big(kind, name, f"the data (~{mb(len(payload) // 4 * 3)})", max_bytes, raise_it)
        payload += "=" * (-len(payload) % 4)
        try:
            if "-" in payload or "_" in payload:  # the URL-safe alphabet
                data = base64.b64decode(payload, altchars=b"-_", validate=True)
            else:
                data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise error(kind, name, f"the data URL is not valid base64 ({e})", fix) from e
    if len(data) > max_bytes:
        raise too_big(kind, name, f"the data ({mb(len(data))})", max_bytes, raise_it)
    if not data:
        raise error(kind, name, "the data URL is empty", fix)
    return data


def read_source_bytes(source: str | os.PathLike | bytes | bytearray | memoryview, *,
                      kind: str, policy: MediaPolicy, max_bytes: int, bytes_option: str,
                      local_reader: Callable[..., Any] | None = None) -> tuple[Any, str]:
    """The encoded bytes of a path, http(s) URL, data URL or bytes source, read under
    ``policy``.

    Returns ``(data, hint)``, where ``hint`` is extra context for a decoding error (e.g.
    the Content-Type the server sent). Shared by every media kind. ``bytes_option``: the
    ``OptionNames`` field that sets ``max_bytes``, for the fix of a file too large.
    ``local_reader`` replaces :func:`_read_file` for local paths (same arguments), e.g. to
    stream a large video from disk instead of reading it into memory.
    """
    name = describe_source(source)
    raise_it = policy.names.raise_fix(bytes_option)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > max_bytes:
            raise too_big(kind, name, "the data", max_bytes, raise_it)
        if not data:
            raise error(kind, name, "the data is empty",
                        f"pass the bytes of {with_article(kind)} file")
        return data, ""
    text = os.fsdecode(source)
    if isinstance(source, str):
        if text[:5].lower() == "data:":
            return _decode_data_url(text, max_bytes=max_bytes, kind=kind, name=name,
                                    raise_it=raise_it), ""
        match = SCHEME_RE.match(text)
        if match:
            scheme = match.group(1).lower()
            if scheme not in _REMOTE_SCHEMES:
                raise error(kind, name, f"{scheme}:// URLs are not supported",
                            "use an http(s):// URL, a data URL or a local path")
            if not policy.allow_remote:
                raise error(kind, name, "fetching remote URLs is disabled",
                            policy.refused_fix("remote"))
            data, content_type = _fetch_url(text, policy=policy, max_bytes=max_bytes,
                                            kind=kind, name=name, raise_it=raise_it)
            hint = f"the server sent Content-Type {content_type!r}" if content_type else ""
            return data, hint
    if not policy.allow_local:
        raise error(kind, name, "reading local files is disabled", policy.refused_fix("local"))
    path = _local_path(text, policy, kind, name)
    reader = local_reader or _read_file
    return reader(path, max_bytes=max_bytes, no_follow=policy.allowed_dir is not None,
                  kind=kind, name=name, raise_it=raise_it), ""
