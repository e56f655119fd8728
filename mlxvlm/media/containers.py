"""What video and audio share: a source opened as a file for PyAV (a local file streamed
from disk, anything else held in memory) and FFmpeg's containers opened safely, with
their errors as :class:`MediaError`. PyAV is imported only when a container is opened."""

from __future__ import annotations

import io
import os
from pathlib import Path

from mlxvlm.media.errors import MediaError, error, with_article
from mlxvlm.media.policy import MediaPolicy
from mlxvlm.media.sources import open_regular_file, read_source_bytes

VIDEO_FIX = "use a common video format (MP4, WebM, MKV, MOV, AVI)"
AUDIO_FIX = "use a common audio format (WAV, MP3, FLAC, OGG, M4A) or a video with sound"


def check_positive(kind: str, name: str, **positive: float) -> None:
    for option, value in positive.items():
        if not value > 0:
            raise error(kind, name, f"{option} must be positive, got {value!r}",
                        f"pass a positive {option}")


def _open_stream(path: Path, *, max_bytes: int, no_follow: bool, kind: str, name: str,
                 raise_it: str = ""):
    """A local file opened for PyAV to read as it goes (large videos stay on disk)."""
    fd = open_regular_file(path, max_bytes=max_bytes, no_follow=no_follow, kind=kind, name=name,
                           raise_it=raise_it)
    return os.fdopen(fd, "rb")


def media_file(source, *, kind: str, policy: MediaPolicy, max_bytes: int):
    """A seekable binary file over the source's encoded bytes, and a decoding hint."""
    data, hint = read_source_bytes(source, kind=kind, policy=policy, max_bytes=max_bytes,
                                   bytes_option="max_bytes", local_reader=_open_stream)
    return (io.BytesIO(data) if isinstance(data, bytes) else data), hint


def open_container(file, *, kind: str, name: str, hint: str):
    import av

    file.seek(0)
    fix = VIDEO_FIX if kind == "video" else AUDIO_FIX
    try:
        # Every source reaches FFmpeg as an open file; whitelisting no protocol stops a
        # container (a playlist, a reference movie) from making FFmpeg open other files
        # or URLs behind the caller's access policy.
        container = av.open(file, mode="r", options={"protocol_whitelist": "none"})
    except av.FFmpegError as e:
        reason = f"not a recognised {kind} format, or the file is truncated or corrupt"
        if hint:
            reason += f" ({hint})"
        raise error(kind, name, reason, fix) from e
    except Exception as e:  # PyAV raises others on some malformed headers
        raise error(kind, name, f"the header is corrupt ({e.__class__.__name__}: {e})",
                    fix) from e
    if container.format.name.endswith("_pipe") or container.format.name == "image2":
        container.close()
        raise error(kind, name, f"it is an image ({container.format.name}), not "
                    f"{with_article(kind)} file",
                    f"pass it as an image, or {fix}")
    return container


def decode_error(kind: str, name: str, e: Exception) -> MediaError:
    return error(kind, name, f"the {kind} data is corrupt or truncated "
                 f"({e.__class__.__name__}: {e})", f"check that the file is a complete {kind}")
