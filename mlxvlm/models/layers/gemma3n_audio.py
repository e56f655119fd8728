"""Gemma 3n's audio encoder (a Universal Speech Model conformer), channels last.

Log-mel frames go through two strided convolutions with cumulative group norms (the
sub-sample convolution projection, SSCP), then conformer blocks: a half-step feed-forward,
chunked local self-attention (each chunk of queries sees itself and a left context, with
relative position logits and soft-capped scores), a light causal depthwise convolution,
another half-step feed-forward; the output keeps every ``conf_reduction_factor``-th frame.

Module names are transformers' (``subsample_conv_projection.conv_0.conv``,
``conformer.<i>.attention.attn.q_proj``, ...); convolution weights are MLX's layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass
class AudioConfig:
    input_feat_size: int = 128
    hidden_size: int = 1536
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    conf_attention_chunk_size: int = 12
    conf_attention_context_left: int = 13
    conf_attention_context_right: int = 0
    conf_attention_logit_cap: float = 50.0
    conf_num_attention_heads: int = 8
    conf_num_hidden_layers: int = 12
    conf_conv_kernel_size: int = 5
    conf_reduction_factor: int = 4
    conf_residual_weight: float = 0.5
    sscp_conv_channel_size: tuple = (128, 32)
    sscp_conv_group_norm_eps: float = 1e-3
    sscp_conv_kernel_size: tuple = ((3, 3), (3, 3))
    sscp_conv_stride_size: tuple = ((2, 2), (2, 2))

    @classmethod
    def from_hf(cls, audio: dict) -> "AudioConfig":
        """From ``audio_config``; what it leaves out is transformers' default."""
        known = {k: v for k, v in audio.items() if k in cls.__dataclass_fields__}
        for key in ("sscp_conv_channel_size", "sscp_conv_kernel_size", "sscp_conv_stride_size"):
            if key in known:
                value = known[key]
                known[key] = tuple(tuple(v) if isinstance(v, (list, tuple)) else v for v in value)
        return cls(**known)


# transformers builds the conformer's norms with Gemma3nRMSNorm's own default, not the
# config's rms_norm_eps (which only the light convolution's norms take).
NORM_EPS = 1e-6


def clip(x: mx.array, limit: float) -> mx.array:
    return mx.clip(x, -limit, limit)


# ------------------------------------------------------------------------------ SSCP


class CumulativeGroupNorm(nn.Module):
    """Normalises each frame by the mean and variance of all frames up to it (over the
    frequency and channel axes), in float32."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.weight = mx.ones((channels,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:  # (B, T, F, C)
        dtype = x.dtype
        x = x.astype(mx.float32)
        per_frame = x.shape[2] * x.shape[3]
        count = mx.arange(1, x.shape[1] + 1, dtype=mx.float32).reshape(1, -1, 1, 1) * per_frame
        mean = mx.cumsum(x.sum(axis=(2, 3), keepdims=True), axis=1) / count
        variance = mx.cumsum(((x - mean) ** 2).sum(axis=(2, 3), keepdims=True), axis=1) / count
        return ((x - mean) * mx.rsqrt(variance + self.eps) * self.weight).astype(dtype)


class SSCPConvBlock(nn.Module):
    """Padding (time: none before, kernel - 1 after; frequency: 1 on each side), a strided
    convolution, the cumulative group norm and ReLU."""

    def __init__(self, cfg: AudioConfig, idx: int):
        super().__init__()
        in_chs = 1 if idx == 0 else cfg.sscp_conv_channel_size[idx - 1]
        out_chs = cfg.sscp_conv_channel_size[idx]
        kh, kw = cfg.sscp_conv_kernel_size[idx]
        self.stride = tuple(cfg.sscp_conv_stride_size[idx])
        self.time_padding = kh - 1
        self.conv = nn.Conv2d(in_chs, out_chs, (kh, kw), stride=self.stride, bias=False)
        self.norm = CumulativeGroupNorm(out_chs, cfg.sscp_conv_group_norm_eps)

    def __call__(self, x: mx.array) -> mx.array:  # (B, T, F, C)
        x = mx.pad(x, [(0, 0), (0, self.time_padding), (1, 1), (0, 0)])
        return nn.relu(self.norm(self.conv(x)))


class SubSampleConvProjection(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.conv_0 = SSCPConvBlock(cfg, 0)
        self.conv_1 = SSCPConvBlock(cfg, 1)
        freq = cfg.input_feat_size
        for (_, kw), (_, sw) in zip(cfg.sscp_conv_kernel_size, cfg.sscp_conv_stride_size):
            freq = (freq + 2 - kw) // sw + 1
        self.input_proj_linear = nn.Linear(freq * cfg.sscp_conv_channel_size[-1], cfg.hidden_size,
                                           bias=False)

    def __call__(self, mel: mx.array) -> mx.array:  # (B, T, F)
        x = self.conv_1(self.conv_0(mel[..., None]))
        B, T, F, C = x.shape
        return self.input_proj_linear(x.reshape(B, T, F * C))


# ------------------------------------------------------------------------- attention


def timing_signal(positions: mx.array, channels: int) -> mx.array:
    """Sinusoids of the relative positions: sines then cosines over ``channels``."""
    count = channels // 2
    increment = math.log(1.0e4) / max(count - 1, 1)
    inv = mx.exp(mx.arange(count, dtype=mx.float32) * -increment)
    scaled = positions.astype(mx.float32)[:, None] * inv[None]
    return mx.concatenate([mx.sin(scaled), mx.cos(scaled)], axis=-1)


class RelativePositionEmbedding(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.num_heads = cfg.conf_num_attention_heads
        self.channels = cfg.hidden_size
        self.head_dim = self.channels // self.num_heads
        self.max_backward = max(0, cfg.conf_attention_context_left - 1)
        self.max_forward = cfg.conf_attention_context_right
        self.pos_proj = nn.Linear(self.channels, self.num_heads * self.head_dim, bias=False)

    def __call__(self, queries: mx.array, keys: mx.array) -> mx.array:
        """queries (B, U, W, N, H), keys (B, U, C, N, H) -> logits (B, N, U, W, C)."""
        B, U, W, N, H = queries.shape
        C = keys.shape[2]
        positions = mx.arange(self.max_backward, -self.max_forward - 1, -1)
        span = positions.shape[0]
        sin_emb = self.pos_proj(timing_signal(positions, self.channels).astype(queries.dtype))
        sin_emb = sin_emb.reshape(span, N, H).transpose(1, 2, 0)  # (N, H, F)
        q = queries.transpose(0, 3, 1, 2, 4)  # (B, N, U, W, H)
        term_ac = q @ keys.transpose(0, 3, 1, 4, 2)  # (B, N, U, W, C)
        term_bd = (q.reshape(B, N, U * W, H) @ sin_emb).reshape(B, N, U, W, span)
        # Relative to absolute key positions: pad to C + 1, fold, and drop the overhang.
        term_bd = mx.pad(term_bd, [(0, 0)] * 4 + [(0, C + 1 - span)])
        term_bd = term_bd.reshape(B, N, U, W * (C + 1))[..., : W * C].reshape(B, N, U, W, C)
        return term_ac + term_bd


class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.num_heads = cfg.conf_num_attention_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        self.chunk = cfg.conf_attention_chunk_size
        self.past = max(0, cfg.conf_attention_context_left - 1)
        self.future = cfg.conf_attention_context_right
        self.context = self.chunk + self.past + self.future
        self.cap = cfg.conf_attention_logit_cap
        self.relative_position_embedding = RelativePositionEmbedding(cfg)
        self.per_dim_scale = mx.zeros((self.head_dim,))
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)

    def _blocks(self, x: mx.array) -> mx.array:
        """(B, T, ...) -> (B, U, chunk, ...), zero-padded at the end."""
        U = -(-x.shape[1] // self.chunk)
        pad = [(0, 0), (0, U * self.chunk - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
        return mx.pad(x, pad).reshape(x.shape[0], U, self.chunk, *x.shape[2:])

    def _contexts(self, x: mx.array) -> mx.array:
        """(B, T, ...) -> (B, U, context, ...): each chunk with its left/right context."""
        U = -(-x.shape[1] // self.chunk)
        pad = [(0, 0), (self.past, self.future + self.chunk - 1)] + [(0, 0)] * (x.ndim - 2)
        x = mx.pad(x, pad)
        index = (mx.arange(U) * self.chunk)[:, None] + mx.arange(self.context)[None]
        return mx.take(x, index.reshape(-1), axis=1).reshape(x.shape[0], U, self.context, *x.shape[2:])

    def __call__(self, x: mx.array, valid: mx.array) -> mx.array:
        """x (B, T, D), valid (B, T) -> (B, T, N, H)."""
        B, T, _ = x.shape
        shape = (B, T, self.num_heads, self.head_dim)
        q = self.q_proj(x).reshape(shape)
        k = self.k_proj(x).reshape(shape)
        v = self.v_proj(x).reshape(shape)
        scale = self.head_dim**-0.5 / math.log(2.0)  # 1 / softplus(0) = 1 / ln 2
        q = q * (scale * nn.softplus(self.per_dim_scale)).astype(q.dtype)
        q_blocks, k_blocks, v_blocks = self._blocks(q), self._contexts(k), self._contexts(v)
        valid_blocks = self._contexts(valid)  # (B, U, C)
        w = mx.arange(self.chunk)[:, None]
        c = mx.arange(self.context)[None]
        causal = (c >= w) & (c <= w + self.past + self.future)  # (W, C)
        allowed = valid_blocks[:, None, :, None, :] & causal  # (B, 1, U, W, C)
        logits = self.relative_position_embedding(q_blocks, k_blocks)
        logits = mx.tanh(logits / self.cap) * self.cap
        logits = mx.where(allowed, logits, mx.finfo(logits.dtype).min)
        probs = mx.softmax(logits.astype(mx.float32), axis=-1).astype(v.dtype)  # (B, N, U, W, C)
        out = probs @ v_blocks.transpose(0, 3, 1, 2, 4)  # (B, N, U, W, H)
        U = q_blocks.shape[1]
        out = out.transpose(0, 2, 3, 1, 4).reshape(B, U * self.chunk, self.num_heads, self.head_dim)
        return out[:, :T]


# ------------------------------------------------------------------------ conformer


class ConformerAttention(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.clip = cfg.gradient_clipping
        self.pre_attn_norm = nn.RMSNorm(cfg.hidden_size, eps=NORM_EPS)
        self.attn = AudioAttention(cfg)
        self.post = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.post_norm = nn.RMSNorm(cfg.hidden_size, eps=NORM_EPS)

    def __call__(self, x: mx.array, valid: mx.array) -> mx.array:
        out = self.attn(self.pre_attn_norm(clip(x, self.clip)), valid)
        out = clip(self.post(out.reshape(*x.shape[:2], -1)), self.clip)
        return x + self.post_norm(out)


class ConformerFeedForward(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.clip = cfg.gradient_clipping
        self.pre_layer_norm = nn.RMSNorm(cfg.hidden_size, eps=NORM_EPS)
        self.ffw_layer_1 = nn.Linear(cfg.hidden_size, cfg.hidden_size * 4, bias=False)
        self.ffw_layer_2 = nn.Linear(cfg.hidden_size * 4, cfg.hidden_size, bias=False)
        self.post_layer_norm = nn.RMSNorm(cfg.hidden_size, eps=NORM_EPS)
        self.post_layer_scale = cfg.conf_residual_weight

    def __call__(self, x: mx.array) -> mx.array:
        y = self.ffw_layer_1(self.pre_layer_norm(clip(x, self.clip)))
        y = clip(self.ffw_layer_2(nn.silu(y)), self.clip)
        return x + self.post_layer_norm(y) * self.post_layer_scale


class ConformerLightConv1d(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        d, k = cfg.hidden_size, cfg.conf_conv_kernel_size
        self.clip = cfg.gradient_clipping
        self.pre_layer_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.linear_start = nn.Linear(d, d * 2, bias=False)
        self.depthwise_conv1d = nn.Conv1d(d, d, k, groups=d, bias=False)
        self.conv_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.linear_end = nn.Linear(d, d, bias=False)
        self.causal_padding = k - 1

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear_start(self.pre_layer_norm(x))
        a, b = mx.split(y, 2, axis=-1)
        y = mx.pad(a * mx.sigmoid(b), [(0, 0), (self.causal_padding, 0), (0, 0)])
        y = clip(self.depthwise_conv1d(y), self.clip)
        return self.linear_end(nn.silu(self.conv_norm(y))) + x


class ConformerBlock(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.clip = cfg.gradient_clipping
        self.ffw_layer_start = ConformerFeedForward(cfg)
        self.attention = ConformerAttention(cfg)
        self.lconv1d = ConformerLightConv1d(cfg)
        self.ffw_layer_end = ConformerFeedForward(cfg)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=NORM_EPS)

    def __call__(self, x: mx.array, valid: mx.array) -> mx.array:
        x = self.attention(self.ffw_layer_start(x), valid)
        x = self.lconv1d(x * valid[..., None].astype(x.dtype))
        return self.norm(clip(self.ffw_layer_end(x), self.clip))


class AudioEncoder(nn.Module):
    """(B, T, mel) frames and their validity (B, T) -> (B, T', hidden) encodings and the
    validity of each (padding encodings are zero)."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.cfg = cfg
        self.subsample_conv_projection = SubSampleConvProjection(cfg)
        self.conformer = [ConformerBlock(cfg) for _ in range(cfg.conf_num_hidden_layers)]

    def __call__(self, mel: mx.array, valid: mx.array) -> tuple[mx.array, mx.array]:
        x = self.subsample_conv_projection(mel)
        stride = math.prod(s[0] for s in self.cfg.sscp_conv_stride_size)
        index = mx.minimum(mx.arange(x.shape[1]) * stride, valid.shape[1] - 1)
        valid = mx.take(valid, index, axis=1)
        for block in self.conformer:
            x = block(x, valid)
        r = self.cfg.conf_reduction_factor
        if r > 1:
            x, valid = x[:, ::r], valid[:, ::r]
        return mx.where(valid[..., None], x, 0.0).astype(x.dtype), valid


def convert_hf_weight(name: str, value: mx.array) -> mx.array:
    """PyTorch convolution weights -> MLX's: (out, in, kh, kw) -> (out, kh, kw, in),
    (out, in, k) -> (out, k, in)."""
    if value.ndim == 4:
        return value.transpose(0, 2, 3, 1)
    if value.ndim == 3:
        return value.transpose(0, 2, 1)
    return value
