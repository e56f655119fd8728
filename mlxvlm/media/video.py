"""Video with PyAV: frames sampled at ``fps`` within a pixel budget (downscaled while
decoding), with the sound track when asked; or frames given directly."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mlxvlm.media.audio import (
    DEFAULT_AUDIO_RATE,
    DEFAULT_MAX_AUDIO_SECONDS,
    Audio,
    AudioCollector,
)
from mlxvlm.media.budget import charge_pixels
from mlxvlm.media.containers import (
    VIDEO_FIX,
    check_positive,
    decode_error,
    media_file,
    open_container,
)
from mlxvlm.media.decode_work import Decoding
from mlxvlm.media.errors import MediaError, describe_source, error, limit_error
from mlxvlm.media.frame_sampling import FALLBACK_FPS, FrameSampler
from mlxvlm.media.images import TRUSTED, load_image
from mlxvlm.media.policy import MediaPolicy

DEFAULT_FPS = FALLBACK_FPS
# Qwen's reference utilities (qwen-vl-utils) sample at most 768 frames.
DEFAULT_MAX_FRAMES = 768
# All sampled frames of one video together, as decoded: what qwen-vl-utils allows a whole
# video (90% of 128k tokens of 28 x 28 pixels), about 270 MB of RGB. Larger videos are
# downscaled while decoding, so a long or 4K video cannot exhaust memory.
DEFAULT_MAX_VIDEO_PIXELS = int(128_000 * 28 * 28 * 0.9)
# Local files are streamed from disk; URLs, data URLs and bytes are held in memory.
DEFAULT_MAX_VIDEO_BYTES = 2**30


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


def sample_frame_indices(total_frames: int, source_fps: float, fps: float | None,
                         max_frames: int, *, num_frames: int | None = None,
                         sampler: FrameSampler | None = None) -> np.ndarray:
    """The indices of the frames ``sampler`` keeps (mlxvlm's even spread when None) at
    ``fps`` or by ``num_frames``; when that is more than ``max_frames``, ``max_frames``
    of them chosen by the same sampler."""
    sampler = sampler or FrameSampler()
    indices = sampler.indices(total_frames, source_fps, fps=fps, num_frames=num_frames)
    if len(indices) > max_frames:
        indices = sampler.indices(total_frames, source_fps, num_frames=max_frames)
    return indices


def fit_pixel_budget(width: int, height: int, frames: int, max_pixels: int) -> tuple[int, int]:
    """The frame size (same aspect ratio) at which ``frames`` frames hold at most
    ``max_pixels`` pixels together; the size itself when they already do."""
    if frames * width * height <= max_pixels:
        return width, height
    scale = (max_pixels / (frames * width * height)) ** 0.5
    return max(1, int(width * scale)), max(1, int(height * scale))


def downscale_note(width: int, height: int, out_w: int, out_h: int, max_pixels: int) -> str:
    if (out_w, out_h) == (width, height):
        return ""
    return (f"downscaled from {width}x{height} to fit the budget of {max_pixels:,} pixels "
            "per video")



def _count_frames(file, *, name: str, hint: str, work: Decoding) -> int:
    """Frames of a video stream whose container does not say (WebM, some MKV): its
    non-empty packets, counted without decoding."""
    import av

    most = work.policy.max_video_frames
    with open_container(file, kind="video", name=name, hint=hint) as container:
        stream = container.streams.video[0]
        count = 0
        try:
            for packet in container.demux(stream):
                work.step()
                count += bool(packet.size)
                if most is not None and count > most:
                    break  # enough to refuse it (claim's at_least)
        except av.FFmpegError as e:
            raise decode_error("video", name, e) from e
        return count


def _frame_size_fix(policy: MediaPolicy, explicit: bool) -> str:
    if explicit:
        return f"downscale it, or raise max_frame_pixels{TRUSTED}"
    return "downscale it" + policy.names.raise_fix("max_image_pixels", TRUSTED)


def _check_frame_size(width: int, height: int, max_frame_pixels: int, name: str,
                      fix: str) -> None:
    if width * height > max_frame_pixels:
        raise limit_error("video", name,
                          f"its frames are {width}x{height} = {width * height:,} pixels, "
                          f"more than the limit of {max_frame_pixels:,}", fix,
                          limit="max_image_pixels")


def _decode_video(file, *, name: str, hint: str, fps: float | None, num_frames: int | None,
                  sampler: FrameSampler | None, max_frames: int, max_pixels: int,
                  max_frame_pixels: int, frame_size_fix: str, audio_rate: int | None,
                  with_audio: bool, max_audio_seconds: float, policy: MediaPolicy) -> Video:
    import av

    with Decoding(policy, "video", name) as work:
        with open_container(file, kind="video", name=name, hint=hint) as container:
            if not container.streams.video:
                raise error("video", name, "the file has no video stream",
                            "pass it as audio if it is a sound file, or " + VIDEO_FIX)
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width <= 0 or height <= 0:
                raise error("video", name, f"the video has no pixels ({width}x{height})",
                            VIDEO_FIX)
            _check_frame_size(width, height, max_frame_pixels, name, frame_size_fix)
            source_fps = float(stream.average_rate or stream.guessed_rate or 0)
            total = stream.frames
            has_audio = with_audio and bool(container.streams.audio)
        if source_fps <= 0:
            raise error("video", name, "the container does not say its frame rate", VIDEO_FIX)
        counted = total <= 0
        if counted:
            total = _count_frames(file, name=name, hint=hint, work=work)
        if total <= 0:
            raise error("video", name, "the video has no frames", "check the file")
        # Before decoding anything: what the container says decoding will cost.
        work.claim(total, width, height, at_least=counted)

        wanted = sample_frame_indices(total, source_fps, fps, max_frames, num_frames=num_frames,
                                      sampler=sampler)
        out_w, out_h = fit_pixel_budget(width, height, len(wanted), max_pixels)
        charge_pixels(len(wanted) * out_w * out_h, name)
        frames, indices, times = [], [], []
        collector = None
        with open_container(file, kind="video", name=name, hint=hint) as container:
            video = container.streams.video[0]
            if work.single_threaded:
                video.thread_count = 1
            else:
                video.thread_type = "AUTO"
            streams = [video]
            if has_audio:
                streams.append(container.streams.audio[0])
                collector = AudioCollector(streams[1], audio_rate, max_audio_seconds, name,
                                           strict=False)
            next_index, position = 0, 0
            try:
                for packet in container.demux(*streams):
                    work.step()
                    for frame in packet.decode():
                        if packet.stream.type == "audio":
                            collector.add(frame)
                            work.step()
                            continue
                        # A container may understate its frames or change their size.
                        _check_frame_size(frame.width, frame.height, max_frame_pixels, name,
                                          frame_size_fix)
                        work.frame(frame.width, frame.height)
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
                raise decode_error("video", name, e) from e
    if not frames:
        raise error("video", name, "no frame could be decoded", "check that the file is a "
                    "complete video")
    note = downscale_note(width, height, out_w, out_h, max_pixels)
    audio = collector.audio() if collector is not None and collector.length else None
    return Video(
        frames=np.stack(frames), frame_indices=np.array(indices), timestamps=np.array(times),
        sampled_fps=len(frames) / (total / source_fps), total_frames=total,
        source_fps=source_fps, source_size=(width, height), name=name, audio=audio, note=note,
    )


def _video_from_frames(frames: Any, *, name: str, fps: float, max_pixels: int,
                       max_frame_pixels: int | None, policy: MediaPolicy) -> Video:
    """Frames given directly (an array or a list of images): taken as they are, as a video
    at ``fps`` frames per second, downscaled only to fit ``max_pixels``. Frames named by
    path or URL are read under the same ``policy`` as any source."""
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise error("video", name, f"the array has shape {tuple(frames.shape)} and dtype "
                        f"{frames.dtype}", "pass uint8 frames of shape (T, H, W, 3)")
        frames = list(frames)
    if not frames:
        raise error("video", name, "the list of frames is empty", "pass at least one frame")
    images = []
    for i, frame in enumerate(frames):
        try:
            images.append(load_image(frame, policy=policy, max_pixels=max_frame_pixels))
        except MediaError as e:
            raise error("video", name, f"frame {i}: {e}") from e
    sizes = {image.size for image in images}
    if len(sizes) > 1:
        raise error("video", name, f"the frames differ in size ({sorted(sizes)})",
                    "pass frames of one size")
    width, height = images[0].size
    out_w, out_h = fit_pixel_budget(width, height, len(images), max_pixels)
    if (out_w, out_h) != (width, height):
        images = [image.resize((out_w, out_h), Image.Resampling.BOX) for image in images]
    note = downscale_note(width, height, out_w, out_h, max_pixels)
    count = len(images)
    return Video(
        frames=np.stack([np.asarray(image) for image in images]),
        frame_indices=np.arange(count), timestamps=np.arange(count) / fps, sampled_fps=fps,
        total_frames=count, source_fps=fps, source_size=(width, height), name=name, note=note,
    )


def load_video(
    source: Any,
    *,
    fps: float | None = None,
    max_frames: int = DEFAULT_MAX_FRAMES,
    num_frames: int | None = None,
    sampler: FrameSampler | None = None,
    max_pixels: int = DEFAULT_MAX_VIDEO_PIXELS,
    max_frame_pixels: int | None = None,
    with_audio: bool = True,
    audio_rate: int | None = DEFAULT_AUDIO_RATE,
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    policy: MediaPolicy | None = None,
    max_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
    **access: Any,
) -> Video:
    """Decode a video with PyAV and sample its frames.

    ``source`` is a local path, an ``http(s)://`` URL, a ``data:video/...;base64,...`` URL,
    the bytes of a video file, a :class:`Video` (returned as is), or frames given directly:
    a uint8 array of shape (T, H, W, 3) or a list of images (anything :func:`load_image`
    takes), which are used as they are, as a video at ``fps`` frames per second.

    - ``fps`` or ``num_frames``: frames sampled per second of video, or how many; which
      ones is the ``sampler``'s choice (a model's ``frame_sampler``, see
      ``mlxvlm.media.frame_sampling``; None: spread evenly from the first to the last
      frame). Neither given: the sampler's defaults (``DEFAULT_FPS`` for the even
      spread). At most ``max_frames`` (then chosen by the same sampler). Frames given
      directly are all used, as a video at ``fps`` (``DEFAULT_FPS`` if None).
    - ``max_pixels``: the budget of all sampled frames together; frames are downscaled
      while decoding to fit it (``Video.note`` says so).
    - ``max_frame_pixels``: the largest frame size accepted from the header, before
      decoding anything, and of every frame decoded (None: the policy's
      ``max_image_pixels``, as for an image). The policy also bounds the decoder's work
      (``max_video_frames``, ``max_video_decode_pixels``, ``max_decode_seconds``; see
      ``mlxvlm.media.decode_work``).
    - ``with_audio``: also decode the first sound track, mono at ``audio_rate`` Hz (None:
      its own rate), into ``Video.audio``; a track longer than ``max_audio_seconds`` is cut.
    - ``policy``, the ``access`` keywords and ``max_bytes``: as for :func:`load_image` (a
      local file is read from disk as it is decoded; other sources are held in memory).

    Every failure (a missing or unreadable file, an unknown format, no video stream, no
    decodable frame, corrupt data, limits) raises :class:`MediaError` naming the source.
    """
    policy = MediaPolicy.of(policy, **access)
    name = describe_source(source)
    if isinstance(source, Video):
        return source
    given = {k: v for k, v in (("fps", fps), ("num_frames", num_frames)) if v is not None}
    check_positive("video", name, max_frames=max_frames, max_pixels=max_pixels, **given)
    if isinstance(source, (np.ndarray, list, tuple)):
        return _video_from_frames(source, name=name, fps=fps or DEFAULT_FPS, max_pixels=max_pixels,
                                  max_frame_pixels=max_frame_pixels, policy=policy)
    if not isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        raise error("video", name, f"unsupported source type {type(source).__name__}",
                    "pass a path, an http(s) or data URL, bytes, a (T, H, W, 3) uint8 array "
                    "or a list of frames")
    file, hint = media_file(source, kind="video", policy=policy, max_bytes=max_bytes)
    frame_size_fix = _frame_size_fix(policy, explicit=max_frame_pixels is not None)
    with file:
        return _decode_video(file, name=name, hint=hint, fps=fps, num_frames=num_frames,
                             sampler=sampler, max_frames=int(max_frames),
                             max_pixels=max_pixels,
                             max_frame_pixels=max_frame_pixels or policy.max_image_pixels,
                             frame_size_fix=frame_size_fix, audio_rate=audio_rate,
                             with_audio=with_audio, max_audio_seconds=max_audio_seconds,
                             policy=policy)
