"""Phi-4-multimodal's conformer audio encoder (transformers' ``Phi4MultimodalAudioModel``).

Log-mel features are normalized by the checkpoint's global mean and inverse deviation,
subsampled in time by ``time_reduction`` (NeMo's striding convolutions: a 3 x 3 stride-2
convolution, then depthwise-separable stride-2 ones, each followed by the activation;
channels and frequency flattened and projected), then run through conformer blocks: half
a feed-forward, attention with a learned T5-style relative position bias, a GLU
pointwise / causal depthwise convolution module, half a feed-forward, LayerNorm.

The attention mask is transformers' as it computes it: the boolean streaming-and-padding
mask *added* to the relative bias (1 where a key may be seen, 0 where not), not -inf.
Sequences longer than 500 steps after subsampling are folded into 500-step chunks that
attend within themselves.

Checkpoint names are transformers' under the encoder (``encoder_embedding.*``,
``embed.conv.{0,2,3,...}``, ``embed.out``, ``relative_attention_bias_layer.*``,
``encoders.N.*``); convolution kernels are stored in MLX's channels-last layout
(``convert_hf_weight``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models.layers.activations import activation

# Steps after subsampling above which transformers folds a clip into chunks.
MAX_STEPS = 500


@dataclass(frozen=True)
class AudioConfig:
    hidden_size: int = 1024
    intermediate_size: int = 1536
    num_blocks: int = 24
    num_attention_heads: int = 16
    activation: str = "swish"
    chunk_size: int = -1
    left_chunk: int = 18
    ext_pw_out_channel: int = 1024
    depthwise_separable_out_channel: int = 1024
    depthwise_multiplier: int = 1
    kernel_size: int = 3
    conv_activation: str = "swish"
    input_size: int = 80
    conv_glu_type: str = "swish"
    time_reduction: int = 8
    bias_max_distance: int = 1000
    bias_symmetric: bool = False
    nemo_activation: str = "relu"
    nemo_conv_channels: int = 1024
    downsample_rate: int = 1
    audio_token_id: int = 200011
    feature_layer: int = -2

    @classmethod
    def from_hf(cls, audio: dict) -> "AudioConfig":
        config = cls(**{f.name: audio[f.name] for f in fields(cls) if f.name in audio})
        for name in (config.activation, config.conv_activation, config.conv_glu_type,
                     config.nemo_activation):
            activation(name)  # an unsupported one is refused when the config is read
        if config.time_reduction % 2 or config.time_reduction < 2:
            raise ValueError("Phi-4-multimodal's audio time_reduction must be a power of 2")
        if config.downsample_rate != 1:  # transformers' projection would not fit its states
            raise NotImplementedError("Phi-4-multimodal with an audio downsample_rate other than 1")
        return config

    @property
    def subsampled_features(self) -> int:
        size = self.input_size
        for _ in range(int(math.log2(self.time_reduction))):
            size = math.floor((size - 1) / 2 + 1)
        return size


class FeedForward(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.hidden_size)
        self.gate_up_proj = nn.Linear(config.hidden_size, config.intermediate_size * 2)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.activation)

    def __call__(self, x: mx.array) -> mx.array:
        up, gate = mx.split(self.gate_up_proj(self.layer_norm(x)), 2, axis=-1)
        return self.down_proj(up * self.act(gate))


class Attention(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        width = self.heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width)
        self.k_proj = nn.Linear(config.hidden_size, width)
        self.v_proj = nn.Linear(config.hidden_size, width)
        self.o_proj = nn.Linear(width, config.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        B, L, _ = x.shape

        def heads(t):
            return t.reshape(B, L, self.heads, self.head_dim).transpose(0, 2, 1, 3)

        out = mx.fast.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
            scale=self.head_dim**-0.5, mask=mask.astype(x.dtype),
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class GluPointwiseConv(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.channels = config.ext_pw_out_channel
        self.ext_pw_conv_1d = nn.Conv1d(config.hidden_size, config.ext_pw_out_channel * 2, 1)
        self.act = activation(config.conv_glu_type)
        # transformers' (1, channels, 1) biases, kept in their shape
        self.b1 = mx.zeros((1, config.ext_pw_out_channel, 1))
        self.b2 = mx.zeros((1, config.ext_pw_out_channel, 1))

    def __call__(self, x: mx.array) -> mx.array:
        h = self.ext_pw_conv_1d(x)
        value, gate = h[..., : self.channels], h[..., self.channels :]
        return (value + self.b1.reshape(-1)) * self.act(gate + self.b2.reshape(-1))


class DepthwiseSeparableConv(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        inner = config.hidden_size * config.depthwise_multiplier
        self.dw_conv = nn.Conv1d(config.hidden_size, inner, config.kernel_size,
                                 padding=config.kernel_size - 1, groups=config.hidden_size)
        self.pw_conv = nn.Conv1d(inner, config.depthwise_separable_out_channel, 1)

    def __call__(self, x: mx.array) -> mx.array:
        return self.pw_conv(self.dw_conv(x))


class ConvModule(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.kernel_size = config.kernel_size
        self.layer_norm = nn.LayerNorm(config.hidden_size)
        self.glu = GluPointwiseConv(config)
        self.dw_sep_conv_1d = DepthwiseSeparableConv(config)
        self.act = activation(config.conv_activation)
        self.ext_pw_conv_1d = nn.Conv1d(config.hidden_size, config.ext_pw_out_channel, 1)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.dw_sep_conv_1d(self.glu(self.layer_norm(x)))
        if self.kernel_size > 1:  # padded both sides: keep the causal part
            h = h[:, : -(self.kernel_size - 1)]
        return self.ext_pw_conv_1d(self.act(h))


class ConformerBlock(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.feed_forward_in = FeedForward(config)
        self.self_attn = Attention(config)
        self.conv = ConvModule(config)
        self.feed_forward_out = FeedForward(config)
        self.layer_norm_att = nn.LayerNorm(config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        residual = x + 0.5 * self.feed_forward_in(x)
        h = residual + self.self_attn(self.layer_norm_att(residual), mask)
        h = h + self.conv(h)
        h = h + 0.5 * self.feed_forward_out(h)
        return self.layer_norm(h)


class Activation(nn.Module):
    """An activation as a module: it holds a place in a list of layers, as in
    transformers' ``nn.Sequential``."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __call__(self, x: mx.array) -> mx.array:
        return activation(self.name)(x)


class Subsampling(nn.Module):
    """NeMo's striding subsampling: (B, T, F) -> (B, ceil(T / reduction), hidden)."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        channels = config.nemo_conv_channels
        act = config.nemo_activation
        layers: list[nn.Module] = [nn.Conv2d(1, channels, 3, stride=2, padding=1), Activation(act)]
        for _ in range(int(math.log2(config.time_reduction)) - 1):
            layers += [nn.Conv2d(channels, channels, 3, stride=2, padding=1, groups=channels),
                       nn.Conv2d(channels, channels, 1), Activation(act)]
        self.conv = layers  # transformers' Sequential indices, activations included
        self.out = nn.Linear(channels * config.subsampled_features, config.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        h = x[..., None]  # (B, T, F, 1): channels last
        for layer in self.conv:
            h = layer(h)
        B, T, F, C = h.shape
        return self.out(h.transpose(0, 1, 3, 2).reshape(B, T, C * F))  # channel-major, as torch


class RelativeAttentionBias(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.max_distance = config.bias_max_distance
        self.symmetric = config.bias_symmetric
        buckets = self.max_distance if self.symmetric else 2 * self.max_distance
        self.bias_values = nn.Embedding(buckets, config.num_attention_heads)

    def __call__(self, length: int) -> mx.array:
        """(1, heads, length, length) biases."""
        position = np.arange(length)
        relative = np.clip(position[None, :] - position[:, None], -self.max_distance,
                           self.max_distance - 1)
        index = np.abs(relative) if self.symmetric else relative + self.max_distance
        return self.bias_values(mx.array(index)).transpose(2, 0, 1)[None]


def streaming_mask(length: int, chunk_size: int, left_chunk: int) -> np.ndarray:
    """(length, length) bool: which steps each step may see, chunk by chunk
    (transformers' ``adaptive_enc_mask`` at inference; a non-positive chunk size sees
    all)."""
    starts = np.arange(0, length, chunk_size) if chunk_size > 0 else np.zeros(0, np.int64)
    start_pad = np.concatenate([[0], starts]).astype(np.int64)
    end_pad = np.concatenate([starts, [length]]).astype(np.int64)
    steps = np.arange(length)[:, None]
    chunk = np.argmax((steps < end_pad[None]) & (steps >= start_pad[None]), axis=1)
    left = start_pad[np.maximum(chunk - left_chunk, 0)]
    right = end_pad[np.minimum(chunk, len(starts))]
    columns = np.arange(length)[None, :]
    return (columns >= left[:, None]) & (columns < right[:, None])


class AudioEncoder(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        # transformers' buffers, loaded from the checkpoint
        self.encoder_embedding = {"global_mean": mx.zeros((config.input_size,)),
                                  "global_invstd": mx.ones((config.input_size,))}
        self.embed = Subsampling(config)
        self.relative_attention_bias_layer = RelativeAttentionBias(config)
        self.encoders = [ConformerBlock(config) for _ in range(config.num_blocks)]

    def __call__(self, features: mx.array, frame_mask: np.ndarray | None) -> mx.array:
        """(B, frames, mel) log-mel features and their (B, frames) validity (None: all
        valid) -> (B, steps, hidden)."""
        c = self.config
        norm = self.encoder_embedding
        h = self.embed((features - norm["global_mean"]) * norm["global_invstd"])
        B, steps, width = h.shape
        valid = None
        if frame_mask is not None:
            kept = -(-np.asarray(frame_mask).sum(1) // c.time_reduction)
            valid = np.arange(steps)[None, :] < kept[:, None]  # (B, steps)
        pad = 0
        if steps > MAX_STEPS:
            pad = -steps % MAX_STEPS
            h = mx.pad(h, [(0, 0), (0, pad), (0, 0)]).reshape(-1, MAX_STEPS, width)
            if valid is not None:
                valid = np.pad(valid, ((0, 0), (0, pad))).reshape(-1, MAX_STEPS)
        length = h.shape[1]
        mask = streaming_mask(length, c.chunk_size, c.left_chunk)[None]  # (1, L, L)
        if valid is not None:
            mask = mask & valid[:, None, :]
        bias = self.relative_attention_bias_layer(length)
        attention_mask = mx.array(mask.astype(np.float32))[:, None] + bias
        for block in self.encoders:
            h = block(h, attention_mask)
        if steps > MAX_STEPS:
            h = h.reshape(B, -1, width)[:, :steps]
        return h


def convert_hf_weight(name: str, value: mx.array) -> mx.array:
    """A transformers tensor of the encoder (``name`` relative to it) in MLX's layout:
    convolution kernels channels-last."""
    if name.endswith(".weight") and (".conv." in f".{name}" or "conv_1d" in name
                                     or "dw_conv" in name or "pw_conv" in name):
        if value.ndim == 4:
            return value.transpose(0, 2, 3, 1)
        if value.ndim == 3:
            return value.transpose(0, 2, 1)
    return value
