"""What decoding a request's videos and audio costs, counted as it is spent, and stopping
it when the request's client goes away.

A server prepares each request inside ``preparing(cancel)``, in the thread that
prepares it. Every video and audio decoded there is charged to that one request: the
pixels of every frame the decoder produces and the CPU seconds of the decoding thread,
against the ``MediaPolicy``'s bounds (``max_video_frames``, ``max_video_decode_pixels``,
``max_decode_seconds``). A video's frame count and size are checked from its container
before anything is decoded, and again frame by frame while decoding, since a container
may understate them. Once ``cancel`` is set, decoding stops at its next packet or frame
with ``PreparationCancelled``. A load outside ``preparing`` (the Python API, the CLI) is
a request of its own.

Each decoded frame costs its pixels whichever frames are kept: a frame depends on the
frames before it, so a video is decoded from its first frame to its last sampled one.
That is why a few hundred kilobytes of frames that repeat the previous picture can cost
minutes of CPU; the bounds are on the decoder's output, not on the file's size.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time

from mlxvlm.errors import MlxvlmError
from mlxvlm.media.errors import limit_error
from mlxvlm.media.policy import MediaPolicy


class PreparationCancelled(MlxvlmError):
    """The request's client went away while its media were being decoded."""


class RequestWork:
    """One request's decoding so far, shared by all of its videos and audio."""

    def __init__(self, cancel: threading.Event | None = None):
        self.cancel = cancel
        self.decoded_pixels = 0
        self.cpu_seconds = 0.0

    def check_cancelled(self, doing: str) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise PreparationCancelled(f"stopped {doing}: the client went away")


_active_work: contextvars.ContextVar[RequestWork | None] = contextvars.ContextVar(
    "mlxvlm_request_work", default=None)


@contextlib.contextmanager
def preparing(cancel: threading.Event | None = None):
    """Charge the media decoded in this block (in this thread) to one request, which
    ``cancel`` stops."""
    work = RequestWork(cancel)
    token = _active_work.set(work)
    try:
        yield work
    finally:
        _active_work.reset(token)


def check_cancelled(doing: str) -> None:
    """Raise ``PreparationCancelled`` if the current request's client is gone."""
    work = _active_work.get()
    if work is not None:
        work.check_cancelled(doing)


class Decoding:
    """One video's or audio's decoding within the current request, as a context manager
    around the decoder's loop: ``claim`` before decoding, ``frame`` for each video frame
    produced, ``step`` between packets and audio frames."""

    def __init__(self, policy: MediaPolicy, kind: str, name: str):
        self.policy = policy
        self.kind, self.name = kind, name
        self.request = _active_work.get() or RequestWork()
        self.frames = 0
        self._started = self._spent_before = 0.0

    def __enter__(self) -> "Decoding":
        self._spent_before = self.request.cpu_seconds
        self._started = time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        self.request.cpu_seconds = self._spent()

    def _spent(self) -> float:
        return self._spent_before + time.thread_time() - self._started

    @property
    def single_threaded(self) -> bool:
        """Whether the decoder must run on this thread alone: a CPU bound counts only the
        time of the thread that checks it."""
        return self.policy.max_decode_seconds is not None

    def _refuse(self, reason: str, fix: str, limit: str):
        names = self.policy.names
        return limit_error(self.kind, self.name, reason, fix + names.raise_fix(limit),
                           limit=limit)

    def claim(self, frames: int, width: int, height: int, *, at_least: bool = False) -> None:
        """Before decoding: the frame count and size the container states (``at_least``:
        its packets were counted only as far as the frame limit)."""
        most = self.policy.max_video_frames
        if most is not None and frames > most:
            reason = (f"it has more than {most:,} frames, the limit per video" if at_least
                      else f"it has {frames:,} frames, more than the limit of {most:,} per "
                      "video")
            raise self._refuse(reason, "send a shorter video", "max_video_frames")
        self._check_pixels(frames * width * height,
                           f"its {frames:,} frames of {width}x{height} are")

    def frame(self, width: int, height: int) -> None:
        """A frame the decoder produced (counted, then the bounds and the client
        checked)."""
        self.frames += 1
        most = self.policy.max_video_frames
        if most is not None and self.frames > most:
            raise self._refuse(f"it holds more than {most:,} frames, the limit per video "
                               "(more than its container says)", "send a shorter video",
                               "max_video_frames")
        self._check_pixels(width * height, f"after {self.frames:,} decoded frames, its "
                           f"{width}x{height} frames are", decoding=True)
        self.request.decoded_pixels += width * height
        self.step()

    def _check_pixels(self, pixels: int, what: str, decoding: bool = False) -> None:
        most = self.policy.max_video_decode_pixels
        if most is None:
            return
        before = self.request.decoded_pixels
        if before + pixels <= most:
            return
        total = f"{before + pixels:,}" if decoding else f"{pixels:,}"
        others = (f" (with the {before:,} of the request's other media)" if before and not
                  decoding else "")
        raise self._refuse(
            f"{what} {total} decoded pixels{others}, more than the limit of {most:,} per "
            "request (every frame is decoded, whichever are sampled)",
            "send a shorter or smaller video", "max_video_decode_pixels")

    def step(self) -> None:
        """Between packets and frames: stop if the client is gone or the request's
        decoding has used its CPU time."""
        after = f" after {self.frames:,} frames" if self.kind == "video" else ""
        self.request.check_cancelled(f"decoding {self.kind} {self.name}{after}")
        most = self.policy.max_decode_seconds
        if most is not None and self._spent() > most:
            raise self._refuse(
                f"decoding the request's media took more than the limit of {most:g} CPU "
                f"seconds (stopped{after or ' while decoding it'})",
                f"send a shorter or smaller {self.kind}", "max_decode_seconds")
