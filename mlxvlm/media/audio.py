"""Audio with PyAV: any source to mono float32 samples at the rate asked for, and the
collector that turns decoded frames into such a track (a video's sound track too)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mlxvlm.media.containers import (
    AUDIO_FIX,
    check_positive,
    decode_error,
    media_file,
    open_container,
)
from mlxvlm.media.decode_work import Decoding
from mlxvlm.media.errors import describe_source, error
from mlxvlm.media.policy import MediaPolicy

DEFAULT_MAX_AUDIO_BYTES = 256 * 2**20
DEFAULT_MAX_AUDIO_SECONDS = 3600.0
# Every audio model mlxvlm supports listens at 16 kHz (Whisper's rate); a video's sound
# track is decoded at this rate unless told otherwise.
DEFAULT_AUDIO_RATE = 16_000


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


class AudioCollector:
    """Decoded audio frames -> one mono float32 track at ``rate`` Hz, at most
    ``max_seconds`` long (``strict``: longer is an error, else the rest is dropped)."""

    def __init__(self, stream, rate: int | None, max_seconds: float, name: str, strict: bool,
                 raise_it: str = ""):
        self.rate = rate or stream.rate
        self.source_rate, self.source_channels = stream.rate, stream.channels
        self.limit = int(max_seconds * self.rate)
        self.name, self.strict = name, strict
        self.raise_it = raise_it  # the end of the fix when strict: OptionNames.raise_fix
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
                raise error("audio", self.name,
                            f"it is longer than the limit of {self.limit / self.rate:g} s",
                            f"cut it shorter{self.raise_it}")
            samples = samples[: self.limit - self.length]
            self.cut = True
        self.chunks.append(samples)
        self.length += samples.shape[0]

    def audio(self) -> Audio:
        samples = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        note = f"cut at the limit of {self.limit / self.rate:g} s" if self.cut else ""
        return Audio(samples.astype(np.float32, copy=False), self.rate, self.name,
                     self.source_rate, self.source_channels, note)



def _decode_audio(file, *, name: str, hint: str, sampling_rate: int | None,
                  max_seconds: float, policy: MediaPolicy) -> Audio:
    import av

    with Decoding(policy, "audio", name) as work, \
            open_container(file, kind="audio", name=name, hint=hint) as container:
        if not container.streams.audio:
            raise error("audio", name, "the file has no audio stream", AUDIO_FIX)
        stream = container.streams.audio[0]
        if work.single_threaded:
            stream.thread_count = 1
        collector = AudioCollector(stream, sampling_rate, max_seconds, name, strict=True,
                                   raise_it=policy.names.raise_fix("max_audio_seconds"))
        try:
            for frame in container.decode(stream):
                work.step()
                collector.add(frame)
            collector.flush()
        except av.FFmpegError as e:
            raise decode_error("audio", name, e) from e
    if not collector.length:
        raise error("audio", name, "it holds no sound (0 samples)", "check the file")
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
        raise error("audio", name, f"cannot resample it from {from_rate} to {to_rate} Hz "
                    f"({e})") from e
    return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)


def _audio_from_array(samples: np.ndarray, rate: int | None, *, name: str,
                      max_seconds: float, raise_it: str) -> Audio:
    fix = "pass a 1-D float array of mono samples in [-1, 1] with its sampling_rate"
    if rate is None:
        raise error("audio", name, "an array of samples needs its sampling rate", fix)
    if samples.ndim != 1 or not np.issubdtype(samples.dtype, np.floating):
        raise error("audio", name, f"the array has shape {tuple(samples.shape)} and dtype "
                    f"{samples.dtype}", fix)
    if not samples.size:
        raise error("audio", name, "the array is empty", fix)
    if samples.size > max_seconds * rate:
        raise error("audio", name, f"it is longer than the limit of {max_seconds:g} s",
                    f"cut it shorter{raise_it}")
    if not np.isfinite(samples).all():
        raise error("audio", name, "the samples contain NaN or infinity", fix)
    return Audio(samples.astype(np.float32), int(rate), name, int(rate), 1)


def load_audio(
    source: Any,
    *,
    sampling_rate: int | None = None,
    max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
    policy: MediaPolicy | None = None,
    max_bytes: int = DEFAULT_MAX_AUDIO_BYTES,
    **access: Any,
) -> Audio:
    """Decode audio with PyAV as mono float32 at ``sampling_rate`` Hz (None: its own rate).

    ``source`` is a local path, an ``http(s)://`` URL, a ``data:audio/...;base64,...`` URL,
    the bytes of a file (any container PyAV reads, videos included: their first sound
    track), an :class:`Audio` (resampled if needed), or samples given directly: a 1-D float
    array at ``sampling_rate`` Hz, or a ``(samples, rate)`` pair. Several channels are
    mixed down to their mean. Longer than ``max_seconds`` is an error; ``policy``, the
    ``access`` keywords and ``max_bytes`` are :func:`load_image`'s. Every failure raises :class:`MediaError`.
    """
    policy = MediaPolicy.of(policy, **access)
    name = describe_source(source)
    check_positive("audio", name, max_seconds=max_seconds)
    if sampling_rate is not None:
        check_positive("audio", name, sampling_rate=sampling_rate)
    raise_it = policy.names.raise_fix("max_audio_seconds")
    if isinstance(source, Audio):
        audio = source
    elif isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], np.ndarray):
        audio = _audio_from_array(source[0], source[1], name=name, max_seconds=max_seconds,
                                  raise_it=raise_it)
    elif isinstance(source, np.ndarray):
        audio = _audio_from_array(source, sampling_rate, name=name, max_seconds=max_seconds,
                                  raise_it=raise_it)
    elif isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        file, hint = media_file(source, kind="audio", policy=policy, max_bytes=max_bytes)
        with file:
            return _decode_audio(file, name=name, hint=hint, sampling_rate=sampling_rate,
                                 max_seconds=max_seconds, policy=policy)
    else:
        raise error("audio", name, f"unsupported source type {type(source).__name__}",
                    "pass a path, an http(s) or data URL, bytes, or a float array with its "
                    "sampling rate")
    return audio if sampling_rate is None else audio.resampled(sampling_rate)
