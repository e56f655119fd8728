"""Naming a media source in messages, and the one-line :class:`MediaError` every loader
raises: which input (shortened, credentials and data URL payloads hidden), what was
wrong and what to do about it."""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import Any

import numpy as np
from PIL import Image

from mlxvlm.errors import MlxvlmError

_NAME_LIMIT = 80
SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


class MediaError(MlxvlmError, ValueError):
    """An input image, video or audio could not be loaded.

    The message is one line: which input, what went wrong, and what to do. As an
    :class:`~mlxvlm.errors.MlxvlmError` the CLIs print it as such and exit with code 2.
    """


class MediaLimitError(MediaError):
    """An input passes one of the limits on what decoding it may cost; ``limit`` names
    the ``MediaPolicy`` field (for counting refusals by limit)."""

    def __init__(self, message: str, *, limit: str):
        super().__init__(message)
        self.limit = limit


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
        if SCHEME_RE.match(source):
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


def error(kind: str, name: str, reason: str, fix: str | None = None) -> MediaError:
    message = f"cannot load {kind} {name}: {_one_line(reason)}"
    if fix:
        message += f"; {_one_line(fix)}"
    return MediaError(message)


def limit_error(kind: str, name: str, reason: str, fix: str, *, limit: str) -> MediaLimitError:
    return MediaLimitError(str(error(kind, name, reason, fix)), limit=limit)


def with_article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n} bytes"


def too_big(kind: str, name: str, size: str, max_bytes: int, raise_it: str = "") -> MediaError:
    """``raise_it``: ``OptionNames.raise_fix`` of the option that sets ``max_bytes``."""
    return error(kind, name, f"{size} is larger than the limit of {mb(max_bytes)}",
                 f"use a smaller file{raise_it}")
