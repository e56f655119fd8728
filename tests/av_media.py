"""Small media files written offline with PyAV, for tests: coloured frames, sine waves,
and containers holding them."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np


def coloured_frames(count: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """(count, height, width, 3) uint8: a smooth colour field that drifts frame by frame,
    so that every frame differs and neighbouring pixels correlate (as in real video)."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width] / max(width, height)
    freq = rng.uniform(1, 4, size=(3, 2))
    phase = rng.uniform(0, 2 * np.pi, size=3)
    frames = []
    for t in range(count):
        channels = [np.sin(2 * np.pi * (fx * xs + fy * ys) + p + 0.6 * t)
                    for (fx, fy), p in zip(freq, phase)]
        frames.append(np.stack(channels, -1) * 0.45 + 0.5)
    return (np.clip(np.stack(frames), 0, 1) * 255).astype(np.uint8)


def sine(seconds: float, rate: int, frequency: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    return (amplitude * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def write_video(path: str | Path, frames: np.ndarray, fps: int = 10, *, codec: str = "mpeg4",
                audio: np.ndarray | None = None, audio_rate: int = 16000,
                audio_codec: str = "aac") -> Path:
    """Write RGB ``frames`` at ``fps`` (and mono ``audio``) into a container chosen by
    the file's suffix (.mp4, .mkv, ...). MPEG-4 part 2 by default: its frames decode the
    same on every run (x264's vary), so parity tests see the same pixels every time."""
    path = Path(path)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.bit_rate = 4_000_000
        sound = None
        if audio is not None:
            sound = container.add_stream(audio_codec, rate=audio_rate)
            sound.layout = "mono"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            _encode_audio(container, sound, audio[None], audio_rate, "mono")
    return path


def write_audio(path: str | Path, samples: np.ndarray, rate: int, *, codec: str | None = None) -> Path:
    """Write float ``samples`` — (n,) mono or (channels, n) — as 16-bit PCM WAV (or with
    ``codec`` into the container the suffix names)."""
    path = Path(path)
    samples = np.atleast_2d(samples).astype(np.float32)
    layout = {1: "mono", 2: "stereo"}[samples.shape[0]]
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec or "pcm_s16le", rate=rate)
        stream.layout = layout
        _encode_audio(container, stream, samples, rate, layout)
    return path


def _encode_audio(container, stream, samples: np.ndarray, rate: int, layout: str) -> None:
    step = 1024
    for start in range(0, samples.shape[1], step):
        chunk = np.ascontiguousarray(samples[:, start : start + step])
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
        frame.sample_rate = rate
        frame.pts = start
        frame.time_base = Fraction(1, rate)
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


def write_repeating_video(path: str | Path, width: int, height: int, frames: int,
                          fps: int = 30) -> Path:
    """An H.264 MP4 of ``frames`` frames at ``width`` x ``height`` that stores one
    keyframe and then the same all-skip frame (a few dozen bytes) again and again: a
    small file whose every frame a decoder must still produce in full, the costliest
    video per byte there is. Encoding two frames and repeating the second's packet keeps
    writing it cheap at any size; the container states the true frame count."""
    path = Path(path)
    picture = np.full((height, width, 3), 90, np.uint8)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps, options={
            "preset": "ultrafast", "bframes": "0", "keyint": str(frames + 1)})
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        packets = []
        for pts in range(2):
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24")
            frame.pts = pts
            packets += stream.encode(frame)
        packets += stream.encode()
        keyframe, skip = packets[0], bytes(packets[1])
        time_base = keyframe.time_base  # the encoder's; muxing rescales the packet
        container.mux(keyframe)
        for pts in range(1, frames):
            packet = av.Packet(skip)
            packet.pts = packet.dts = pts
            packet.time_base = time_base
            packet.stream = stream
            container.mux(packet)
    return path
