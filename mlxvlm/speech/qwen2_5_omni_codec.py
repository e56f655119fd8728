"""Qwen2.5-Omni's token2wav as a codec stream (``speech.codec.CodecStream``'s interface):
its DiT attends a block ahead and integrates the whole mel at once, so the codes are
decoded together when the talker ends (``flush``), in the voice's conditioning."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.speech.codec import SAMPLE_RATE
from mlxvlm.speech.spk_dict import Voice


class Token2WavStream:
    def __init__(self, token2wav, voice: Voice, noise: mx.array | None = None):
        self.token2wav = token2wav
        self.voice = voice
        self.noise = noise
        self.pending: list[int] = []
        self.decoded_frames = 0
        self.sample_rate = SAMPLE_RATE

    def push(self, frame: np.ndarray) -> None:
        self.pending.append(int(frame))

    def flush(self) -> np.ndarray | None:
        if not self.pending:
            return None
        codes, self.pending = np.array(self.pending, np.int64), []
        return self.decode(codes)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        codebook = self.token2wav.config.dit.num_embeds + 1
        outside = np.asarray(codes)[(np.asarray(codes) < 0) | (np.asarray(codes) >= codebook)]
        if outside.size:
            raise MlxvlmError(f"the talker spoke code {int(outside[0])}, outside token2wav's "
                              f"codebook of {codebook}")
        samples = self.token2wav(mx.array(np.asarray(codes).reshape(1, -1)),
                                 mx.array(self.voice.conditioning),
                                 mx.array(self.voice.reference_mel), self.noise)
        self.decoded_frames += len(codes)
        return np.asarray(samples[0].astype(mx.float32))
