"""The Whisper-style audio encoder of Qwen2-Audio and Qwen2.5-Omni.

Log-mel features (the processor's ``WhisperFeatureExtractor``, 100 frames per second) are
cut into windows of ``2 * n_window`` frames. Each window goes through Whisper's stem — two
convolutions with GELU, the second of stride 2 — plus sinusoidal positions counted from
the window's start, and through pre-norm transformer blocks that attend within the window
only. The tokens of each whole audio are then averaged in pairs (stride-2 pooling),
normalized and projected to the text model's width: 25 tokens per second.

Checkpoint names (Hugging Face's, kept): ``conv1``, ``conv2``, ``layers.N.self_attn.{q,k,v,
out}_proj`` (no key bias), ``layers.N.self_attn_layer_norm``, ``layers.N.fc1/fc2``,
``layers.N.final_layer_norm``, ``ln_post``, ``proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import run_ahead
from mlxvlm.cpu.ops import scaled_dot_product_attention


@dataclass
class AudioConfig:
    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    output_dim: int = 3584
    n_window: int = 100  # half a window, in mel frames
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    key_bias: bool = False  # Whisper's attention keys have none; Qwen3-Omni's do

    @classmethod
    def from_hf(cls, audio: dict) -> "AudioConfig":
        defaults = cls()
        return cls(**{key: audio.get(key, getattr(defaults, key)) for key in cls.__dataclass_fields__
                      if key != "key_bias"})


def output_lengths(mel_frames: np.ndarray) -> np.ndarray:
    """Audio tokens for each audio of ``mel_frames`` frames (the stride-2 convolution,
    then the stride-2 pooling)."""
    after_conv = (np.asarray(mel_frames) - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's fixed positions: sines then cosines over geometric timescales."""
    increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = np.exp(-increment * np.arange(channels // 2, dtype=np.float32))
    scaled = np.arange(length, dtype=np.float32)[:, None] * inv_timescales[None, :].astype(np.float32)
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1).astype(np.float32)


def window_lengths(mel_frames: np.ndarray, n_window: int) -> np.ndarray:
    """Each audio cut into windows of ``2 * n_window`` frames (the last one shorter):
    every window's length, audio after audio."""
    size = 2 * n_window
    lengths = []
    for frames in np.asarray(mel_frames).tolist():
        full, rest = divmod(frames, size)
        lengths += [size] * full + ([rest] if rest else [])
    return np.array(lengths, dtype=np.int64)


ACTIVATIONS = {"gelu": nn.gelu, "gelu_new": nn.gelu_approx, "relu": nn.relu}


class AudioAttention(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        dim = config.d_model
        self.num_heads = config.encoder_attention_heads
        self.scale = (dim // self.num_heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=config.key_bias)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        """``x`` (windows, length, dim); ``mask`` (windows, 1, 1, length): True where a
        key is inside its window (padding is never attended to)."""
        B, L, D = x.shape
        split = lambda t: t.reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, D))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.self_attn = AudioAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)
        self.act = ACTIVATIONS[config.activation_function]

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """``audio_tower`` in checkpoints: mel features -> (audio tokens, output_dim)."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        # Weights in MLX's channels-last layout: (out, kernel, in).
        self.conv1 = nn.Conv1d(config.num_mel_bins, config.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(config.d_model, config.d_model, kernel_size=3, stride=2, padding=1)
        self.layers = [AudioEncoderLayer(config) for _ in range(config.encoder_layers)]
        self.ln_post = nn.LayerNorm(config.d_model)
        self.proj = nn.Linear(config.d_model, config.output_dim)
        self._positions = mx.array(sinusoids(config.max_source_positions, config.d_model))

    def __call__(self, features: mx.array, mel_frames: np.ndarray) -> mx.array:
        """``features`` (mel bins, total frames): every audio's valid frames one after the
        other; ``mel_frames``: how many frames each audio has. Returns the tokens of all
        audios in order, ``output_lengths(mel_frames)`` of each."""
        mel_frames = np.asarray(mel_frames, dtype=np.int64).reshape(-1)
        lengths = window_lengths(mel_frames, self.config.n_window)
        longest = int(lengths.max())
        # (windows, longest, mel bins), zero-padded after each window's frames
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        gather = starts[:, None] + np.arange(longest)[None, :]
        inside = np.arange(longest)[None, :] < lengths[:, None]
        frames = features.T[mx.array(np.where(inside, gather, 0))] * mx.array(inside[..., None])

        x = nn.gelu(self.conv1(frames.astype(self.conv1.weight.dtype)))
        x = x * mx.array(inside[..., None]).astype(x.dtype)  # padding stays zero for conv2
        x = nn.gelu(self.conv2(x))
        x = x + self._positions[: x.shape[1]].astype(x.dtype)

        kept = (lengths - 1) // 2 + 1  # tokens of each window after the stride-2 conv
        keys = np.arange(x.shape[1])[None, :] < kept[:, None]
        mask = mx.array(keys[:, None, None, :])
        for layer in self.layers:
            x = layer(x, mask)
            run_ahead.layer_done(x)

        # Each audio's tokens (windows concatenated), averaged in pairs.
        tokens = x.reshape(-1, x.shape[-1])[mx.array(np.flatnonzero(keys.reshape(-1)))]
        after_conv = (mel_frames - 1) // 2 + 1
        offsets = np.concatenate([[0], np.cumsum(after_conv)[:-1]])
        pairs = np.concatenate([offset + 2 * np.arange(n) for offset, n in
                                zip(offsets, output_lengths(mel_frames))])
        pooled = (tokens[mx.array(pairs)] + tokens[mx.array(pairs + 1)]) / 2
        return self.proj(self.ln_post(pooled))


def sanitize_conv_weights(name: str, value: mx.array) -> mx.array:
    """PyTorch Conv1d weights (out, in, kernel) -> MLX's (out, kernel, in)."""
    if name.endswith(("conv1.weight", "conv2.weight")):
        return value.transpose(0, 2, 1)
    return value
