"""code2wav as a stream: frames in, waveform chunks out, decoded every ``chunk_frames``
frames (a smaller first chunk, so the first audio comes early). Each chunk continues the
last exactly (``Code2WavStream``'s left context): the chunks concatenate to the one-shot
waveform."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxvlm.models.layers.qwen3_omni_code2wav import Code2WavStream

FIRST_CHUNK_FRAMES = 4
CHUNK_FRAMES = 24
SAMPLE_RATE = 24000


class CodecStream:
    def __init__(self, code2wav, first_chunk_frames: int = FIRST_CHUNK_FRAMES,
                 chunk_frames: int = CHUNK_FRAMES):
        if first_chunk_frames < 1 or chunk_frames < 1:
            raise ValueError("chunks must hold at least one frame")
        self.code2wav = code2wav
        self.stream = Code2WavStream()
        self.pending: list[np.ndarray] = []
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self.decoded_frames = 0
        self.sample_rate = SAMPLE_RATE

    def push(self, frame: np.ndarray) -> np.ndarray | None:
        """Add one frame's codes; the next chunk of samples once enough frames wait."""
        self.pending.append(np.asarray(frame))
        wanted = self.first_chunk_frames if self.decoded_frames == 0 else self.chunk_frames
        if len(self.pending) >= wanted:
            return self.flush()
        return None

    def flush(self) -> np.ndarray | None:
        """Decode whatever frames wait (the end of the speech)."""
        if not self.pending:
            return None
        codes = mx.array(np.stack(self.pending)[None])
        self.decoded_frames += len(self.pending)
        self.pending = []
        samples = self.code2wav(codes, self.stream)
        return np.asarray(samples[0].astype(mx.float32))

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """All of ``codes`` (frames, groups) at once, on this stream."""
        samples = self.code2wav(mx.array(np.asarray(codes)[None]), self.stream)
        self.decoded_frames += len(codes)
        return np.asarray(samples[0].astype(mx.float32))
