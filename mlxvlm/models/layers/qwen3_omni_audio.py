"""Qwen3-Omni's audio encoder (the AuT encoder of the thinker).

Log-mel features (the processor's ``WhisperFeatureExtractor``, 100 frames per second) are
cut into chunks of ``2 * n_window`` frames (1 s; the last one shorter), zero-padded to the
longest chunk. Each chunk goes through a stem of three 3x3 convolutions of stride 2 over
(mel bin, time), with GELU, whose channels and remaining mel bins are flattened and
projected (``conv_out``) — 8x fewer frames, 13 tokens per second — plus sinusoidal
positions counted from the chunk's start. The chunks' valid tokens are then put back one
after the other and pre-norm transformer blocks (Whisper's, with key biases) attend within
windows of ``n_window_infer / (2 * n_window)`` chunks of each audio; a final norm and a
two-layer projection reach the text model's width.

Checkpoint names (Hugging Face's, kept, as mlx-community's): ``conv2d1``-``conv2d3``,
``conv_out``, ``layers.N.*`` (as Whisper's), ``ln_post``, ``proj1``, ``proj2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import run_ahead
from mlxvlm.models.layers.whisper_audio import (
    ACTIVATIONS,
    AudioConfig,
    AudioEncoderLayer,
    sinusoids,
    window_lengths,
)

STEM_CONVOLUTIONS = 3


@dataclass
class Qwen3AudioConfig(AudioConfig):
    n_window: int = 50  # half a chunk, in mel frames
    n_window_infer: int = 800  # an attention window, in mel frames
    downsample_hidden_size: int = 480
    key_bias: bool = True


def after_stem(frames: np.ndarray) -> np.ndarray:
    """Tokens of a chunk of ``frames`` mel frames after the three stride-2 convolutions."""
    frames = np.asarray(frames, dtype=np.int64)
    for _ in range(STEM_CONVOLUTIONS):
        frames = (frames - 1) // 2 + 1
    return frames


def output_lengths(mel_frames: np.ndarray, n_window: int) -> np.ndarray:
    """Audio tokens for each audio of ``mel_frames`` frames: its chunks' tokens summed."""
    return np.array([after_stem(window_lengths([frames], n_window)).sum()
                     for frames in np.asarray(mel_frames).reshape(-1).tolist()], dtype=np.int64)


def attention_windows(mel_frames: np.ndarray, config: Qwen3AudioConfig,
                      longest_chunk: int) -> list[int]:
    """The lengths, in tokens, of the windows attention runs within: each audio's tokens
    cut every ``chunks per window x the longest chunk's tokens`` (as transformers' cu_seqlens)."""
    window = longest_chunk * (config.n_window_infer // (2 * config.n_window))
    lengths = []
    for tokens in output_lengths(mel_frames, config.n_window).tolist():
        full, rest = divmod(tokens, window)
        lengths += [window] * full + ([rest] if rest else [])
    return lengths


def padded_rows(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For runs of ``lengths`` rows one after the other, padded to the longest: each padded
    slot's row (0 where padding) and whether it holds one, both (runs, longest)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    slots = np.arange(int(lengths.max()))[None, :]
    inside = slots < lengths[:, None]
    return np.where(inside, starts[:, None] + slots, 0), inside


class AudioEncoder(nn.Module):
    """``audio_tower`` in checkpoints: mel features -> (audio tokens, output_dim)."""

    def __init__(self, config: Qwen3AudioConfig):
        super().__init__()
        self.config = config
        width = config.downsample_hidden_size
        # Weights in MLX's channels-last layout: (out, kh, kw, in), over (mel bin, time).
        self.conv2d1 = nn.Conv2d(1, width, 3, stride=2, padding=1)
        self.conv2d2 = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.conv2d3 = nn.Conv2d(width, width, 3, stride=2, padding=1)
        bins = int(after_stem(config.num_mel_bins))
        self.conv_out = nn.Linear(width * bins, config.d_model, bias=False)
        self.layers = [AudioEncoderLayer(config) for _ in range(config.encoder_layers)]
        self.ln_post = nn.LayerNorm(config.d_model)
        self.proj1 = nn.Linear(config.d_model, config.d_model)
        self.proj2 = nn.Linear(config.d_model, config.output_dim)
        self.act = ACTIVATIONS[config.activation_function]
        self._positions = mx.array(sinusoids(config.max_source_positions, config.d_model))

    def __call__(self, features: mx.array, mel_frames: np.ndarray) -> mx.array:
        """``features`` (mel bins, total frames): every audio's valid frames one after the
        other; ``mel_frames``: how many frames each audio has. Returns the tokens of all
        audios in order, ``output_lengths(mel_frames)`` of each."""
        config = self.config
        mel_frames = np.asarray(mel_frames, dtype=np.int64).reshape(-1)
        chunks = window_lengths(mel_frames, config.n_window)
        rows, inside = padded_rows(chunks)
        # (chunks, mel bins, frames, 1): channels last, zero after each chunk's frames
        x = (features.T[mx.array(rows)] * mx.array(inside[..., None])).transpose(0, 2, 1)
        x = x[..., None].astype(self.conv2d1.weight.dtype)
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = nn.gelu(conv(x))
        n, bins, frames, width = x.shape
        # (chunks, frames, channels x bins), as the reference flattens (channels, bins)
        x = self.conv_out(x.transpose(0, 2, 3, 1).reshape(n, frames, width * bins))
        x = x + self._positions[:frames].astype(x.dtype)

        kept = after_stem(chunks)
        valid = np.flatnonzero(np.arange(frames)[None, :] < kept[:, None])
        tokens = x.reshape(-1, x.shape[-1])[mx.array(valid)]

        windows = attention_windows(mel_frames, config, int(kept.max()))
        rows, inside = padded_rows(windows)
        x = tokens[mx.array(rows)]
        mask = mx.array(inside[:, None, None, :])
        for layer in self.layers:
            x = layer(x, mask)
            run_ahead.layer_done(x)
        x = x.reshape(-1, x.shape[-1])[mx.array(np.flatnonzero(inside))]
        return self.proj2(self.act(self.proj1(self.ln_post(x))))


def sanitize_conv_weights(name: str, value: mx.array) -> mx.array:
    """PyTorch Conv2d weights (out, in, kh, kw) -> MLX's (out, kh, kw, in)."""
    if name.startswith("conv2d") and name.endswith(".weight") and value.ndim == 4:
        return value.transpose(0, 2, 3, 1)
    return value
