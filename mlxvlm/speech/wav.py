"""Float waveforms as 16-bit PCM WAV (the stdlib's ``wave``: no audio library needed)."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np


def pcm16(audio: np.ndarray) -> bytes:
    """Mono float samples in [-1, 1] -> little-endian 16-bit PCM."""
    clipped = np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0)
    return (np.round(clipped * 32767.0)).astype("<i2").tobytes()


def wav_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm16(audio))
    return buffer.getvalue()


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> None:
    Path(path).write_bytes(wav_bytes(audio, sample_rate))
