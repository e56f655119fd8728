"""Gemma 4's audio encoder, a Universal-Speech-Model-style conformer over the feature
extractor's log-mel frames:

- two 3x3 stride-2 convolutions (LayerNorm without bias, ReLU) cut time and frequency
  by four, then a linear projection to the model width;
- per block: a half-weighted feed-forward, local self-attention (each frame sees the
  few frames before it, and after it, that transformers' window takes) with a learned per-dimension query scale, a Transformer-XL relative position term
  over sinusoidal distances and soft-capped logits, a light causal depthwise
  convolution, a second feed-forward and a final RMS norm;
- a biased output projection.

transformers computes the attention block by block (chunks of ``attention_chunk_size``
queries over their context window); every query's logits there are those of its own
window, which this computes over the whole sequence with the window as a mask: the same
numbers, for the frames that are kept. Names are transformers' (``subsample_conv_projection.*``,
``layers.N.*``, ``output_proj``), which are also mlx-community's under ``audio_tower.``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models.layers.gemma4_vision import ClippableLinear
from mlxvlm.models.config_utils import with_defaults

# transformers' Gemma4AudioConfig defaults
AUDIO_DEFAULTS = dict(
    hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, hidden_act="silu",
    subsampling_conv_channels=(128, 32), conv_kernel_size=5, residual_weight=0.5,
    attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
    attention_logit_cap=50.0, attention_invalid_logits_value=-1.0e9, use_clipped_linears=True,
    rms_norm_eps=1e-6, gradient_clipping=1e10, output_proj_dims=1536,
)
# transformers' Gemma4RMSNorm default, which some of the encoder's norms keep
DEFAULT_EPS = 1e-6


@dataclass(frozen=True)
class AudioConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    hidden_act: str
    subsampling_conv_channels: tuple[int, int]
    conv_kernel_size: int
    residual_weight: float
    attention_chunk_size: int
    attention_context_left: int
    attention_context_right: int
    attention_logit_cap: float
    attention_invalid_logits_value: float
    use_clipped_linears: bool
    rms_norm_eps: float
    gradient_clipping: float
    output_proj_dims: int

    @classmethod
    def from_hf(cls, audio: dict) -> "AudioConfig":
        values = with_defaults(audio, AUDIO_DEFAULTS)
        values["subsampling_conv_channels"] = tuple(values["subsampling_conv_channels"])
        if values["hidden_act"] != "silu":
            raise NotImplementedError(
                f"Gemma 4 audio activation {values['hidden_act']!r} is not supported"
            )
        return cls(**values)


def clamp(x: mx.array, bound: float) -> mx.array:
    """transformers' guard against overflow, bounded by the dtype's range."""
    bound = min(bound, float(mx.finfo(x.dtype).max))
    return mx.clip(x, -bound, bound)


class SubsampleLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def __call__(self, x: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        x = x * mask[:, :, None, None]
        x = nn.relu(self.norm(self.conv(x)))
        return x, mask[:, ::2]


class SubsampleConvProjection(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        first, second = config.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, first, config.rms_norm_eps)
        self.layer1 = SubsampleLayer(first, second, config.rms_norm_eps)
        self.input_proj_linear = nn.Linear((first // 4) * second, config.hidden_size, bias=False)

    def __call__(self, features: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        x, mask = self.layer0(features[..., None], mask)  # channels last: (B, T, F, C)
        x, mask = self.layer1(x, mask)
        B, T = x.shape[:2]
        return self.input_proj_linear(x.reshape(B, T, -1)), mask


class FeedForward(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        clipped, width = config.use_clipped_linears, config.hidden_size
        self.ffw_layer_1 = ClippableLinear(width, 4 * width, clipped)
        self.ffw_layer_2 = ClippableLinear(4 * width, width, clipped)
        self.pre_layer_norm = nn.RMSNorm(width, eps=DEFAULT_EPS)
        self.post_layer_norm = nn.RMSNorm(width, eps=DEFAULT_EPS)
        self.clip = config.gradient_clipping
        self.scale = config.residual_weight

    def __call__(self, x: mx.array) -> mx.array:
        h = self.pre_layer_norm(clamp(x, self.clip))
        h = self.ffw_layer_2(nn.silu(self.ffw_layer_1(h)))
        return x + self.post_layer_norm(clamp(h, self.clip)) * self.scale


def relative_positions(config: AudioConfig) -> mx.array:
    """The sinusoidal embeddings ([sin, cos]) of the distances transformers' blocked
    attention indexes, largest first."""
    context = (config.attention_chunk_size + config.attention_context_left - 1
               + config.attention_context_right)
    half = config.hidden_size // 2
    increment = math.log(10000.0) / max(half - 1, 1)
    inv_timescales = mx.exp(mx.arange(half, dtype=mx.float32) * -increment)
    positions = mx.arange(context // 2, -1, -1, dtype=mx.float32)[:, None] * inv_timescales
    return mx.concatenate([mx.sin(positions), mx.cos(positions)], axis=-1)


class Attention(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.heads
        clipped, width = config.use_clipped_linears, config.hidden_size
        self.q_proj = ClippableLinear(width, width, clipped)
        self.k_proj = ClippableLinear(width, width, clipped)
        self.v_proj = ClippableLinear(width, width, clipped)
        self.post = ClippableLinear(width, width, clipped)
        self.relative_k_proj = nn.Linear(width, width, bias=False)
        self.per_dim_scale = mx.zeros((self.head_dim,))
        self.q_scale = (self.head_dim**-0.5) / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.past = config.attention_context_left - 1
        self.future = config.attention_context_right
        self.cap = config.attention_logit_cap
        self.invalid = config.attention_invalid_logits_value

    def __call__(self, x: mx.array, positions: mx.array, allowed: mx.array) -> mx.array:
        """``allowed``: (B, 1, T, T), which keys each frame's query may see."""
        B, T, _ = x.shape

        def heads(t):
            return t.reshape(B, T, self.heads, self.head_dim).transpose(0, 2, 1, 3)

        q = heads(self.q_proj(x).astype(mx.float32)) * self.q_scale * nn.softplus(self.per_dim_scale)
        k = heads(self.k_proj(x).astype(mx.float32)) * self.k_scale
        v = heads(self.v_proj(x).astype(mx.float32))
        content = q @ k.transpose(0, 1, 3, 2)  # (B, H, T, T)
        relative = self.relative_k_proj(positions).astype(mx.float32)
        relative = relative.reshape(-1, self.heads, self.head_dim).transpose(1, 2, 0)  # (H, D, P)
        by_distance = q @ relative  # (B, H, T, P): P distances, largest first
        # key j of query i reads distance entry j - i + past (zero where there is none)
        offset = mx.arange(T)[None, :] - mx.arange(T)[:, None] + self.past
        inside = (offset >= 0) & (offset < relative.shape[-1])
        index = mx.broadcast_to(mx.clip(offset, 0, relative.shape[-1] - 1), (B, self.heads, T, T))
        position = mx.where(inside, mx.take_along_axis(by_distance, index, axis=-1), 0.0)
        logits = mx.tanh((content + position) / self.cap) * self.cap
        logits = mx.where(allowed, logits, self.invalid)
        out = mx.softmax(logits, axis=-1, precise=True) @ v
        return self.post(out.transpose(0, 2, 1, 3).reshape(B, T, -1).astype(x.dtype))


class LightConv1d(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        clipped, width, eps = config.use_clipped_linears, config.hidden_size, config.rms_norm_eps
        self.linear_start = ClippableLinear(width, 2 * width, clipped)
        self.linear_end = ClippableLinear(width, width, clipped)
        self.depthwise_conv1d = nn.Conv1d(width, width, config.conv_kernel_size, groups=width,
                                          bias=False)
        self.pre_layer_norm = nn.RMSNorm(width, eps=eps)
        self.conv_norm = nn.RMSNorm(width, eps=eps)
        self.kernel = config.conv_kernel_size
        self.clip = config.gradient_clipping

    def __call__(self, x: mx.array) -> mx.array:
        h = self.linear_start(self.pre_layer_norm(x))
        a, b = mx.split(h, 2, axis=-1)
        h = a * mx.sigmoid(b)
        h = self.depthwise_conv1d(mx.pad(h, [(0, 0), (self.kernel - 1, 0), (0, 0)]))  # causal
        h = nn.silu(self.conv_norm(clamp(h, self.clip)))
        return x + self.linear_end(h)


class ConformerLayer(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        width = config.hidden_size
        self.feed_forward1 = FeedForward(config)
        self.feed_forward2 = FeedForward(config)
        self.self_attn = Attention(config)
        self.lconv1d = LightConv1d(config)
        self.norm_pre_attn = nn.RMSNorm(width, eps=DEFAULT_EPS)
        self.norm_post_attn = nn.RMSNorm(width, eps=DEFAULT_EPS)
        self.norm_out = nn.RMSNorm(width, eps=DEFAULT_EPS)
        self.clip = config.gradient_clipping

    def __call__(self, x, positions, allowed):
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(clamp(x, self.clip)), positions, allowed)
        x = x + self.norm_post_attn(clamp(h, self.clip))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(clamp(x, self.clip))


class AudioModel(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        self.subsample_conv_projection = SubsampleConvProjection(config)
        self.layers = [ConformerLayer(config) for _ in range(config.num_hidden_layers)]
        self.output_proj = nn.Linear(config.hidden_size, config.output_proj_dims, bias=True)

    def __call__(self, features: mx.array, mask: mx.array) -> mx.array:
        """The real frames' encodings of every clip, concatenated in order: (frames,
        output_proj_dims), from the extractor's (B, T, mels) features and (B, T) mask."""
        config = self.config
        x, mask = self.subsample_conv_projection(features, mask.astype(features.dtype))
        valid = mask > 0
        T = x.shape[1]
        # transformers' window, (left, right) = (context_left - 1, context_right), both
        # exclusive but for the frame itself
        left, right = config.attention_context_left - 1, config.attention_context_right
        distance = mx.arange(T)[None, :] - mx.arange(T)[:, None]  # key - query
        window = ((distance <= 0) & (distance > -left)) | ((distance > 0) & (distance < right))
        allowed = (window[None] & valid[:, None, :])[:, None]
        positions = relative_positions(config).astype(x.dtype)
        for layer in self.layers:
            x = layer(x, positions, allowed)
        x = self.output_proj(x)
        rows = np.flatnonzero(np.asarray(valid).reshape(-1))
        return x.reshape(-1, x.shape[-1])[mx.array(rows)]
