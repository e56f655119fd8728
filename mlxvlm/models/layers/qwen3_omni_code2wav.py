"""Qwen3-Omni's code2wav: a frame of codec codes (one per code group) -> 24 kHz samples.

The codes' embeddings are averaged over the groups, run through a small transformer
(causal attention within a sliding window, layer scales), upsampled by causal transposed
convolutions with ConvNeXt blocks, then decoded by a BigVGAN-like stack of causal
convolutions and SnakeBeta activations.

Every part is causal, so the decoder runs as a stream: each part keeps the left context
it needs (a convolution its last inputs, a transposed convolution its last frame, the
attention its keys and values within the window) in a ``Code2WavStream``, and chunks
decoded one after another concatenate to the one-shot waveform: there is no seam to
overlap or drop. transformers' ``chunked_decode`` instead re-decodes 25 frames of left
context per chunk, which does not reach past the attention window of every layer, so its
seams differ slightly from the one-shot waveform; this stream does not.

Layouts are MLX's (time before channels); ``sanitize`` turns PyTorch's convolution
weights ((out, in, k), and (in, out, k) for the transposed ones) into them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.cpu.ops import gated, silu
from mlxvlm.models.config_utils import rope_parameters
from mlxvlm.models.layers.conv1d_products import SnakeBeta, shifted_products

swiglu = gated(silu)


@dataclass(frozen=True)
class Code2WavConfig:
    codebook_size: int = 2048
    hidden_size: int = 1024
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    sliding_window: int = 72
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, config: dict) -> "Code2WavConfig":
        """transformers' ``code2wav_config`` in either layout (its defaults where a key is
        missing)."""
        fields = {k: config[k] for k in cls.__dataclass_fields__ if k in config}
        for key in ("upsample_rates", "upsampling_ratios"):
            if key in fields:
                fields[key] = tuple(fields[key])
        fields["rope_theta"] = rope_parameters(config, 10000.0)["rope_theta"]
        if config.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"code2wav hidden_act {config['hidden_act']!r}")
        return cls(**fields)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)


class Code2WavStream:
    """The left context each causal part keeps between chunks of one waveform, and the
    number of frames decoded so far (the attention's next position)."""

    def __init__(self):
        self.context: dict[int, Any] = {}
        self.frames = 0

    def take(self, part: nn.Module, default=None):
        return self.context.get(id(part), default)

    def keep(self, part: nn.Module, value) -> None:
        self.context[id(part)] = value


class CausalConv(nn.Module):
    """A stride-1 convolution padded on the left only: its stream keeps the last
    ``(kernel - 1) * dilation`` inputs."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, dilation: int = 1,
                 groups: int = 1):
        super().__init__()
        self.weight = mx.zeros((out_channels, kernel, in_channels // groups))
        self.bias = mx.zeros((out_channels,))
        self.dilation = dilation
        self.groups = groups
        self.left = (kernel - 1) * dilation

    def __call__(self, x: mx.array, stream: Code2WavStream) -> mx.array:
        if self.left:
            before = stream.take(self)
            if before is None:
                before = mx.zeros((x.shape[0], self.left, x.shape[2]), x.dtype)
            x = mx.concatenate([before, x], axis=1)
            stream.keep(self, x[:, -self.left:])
        return shifted_products(x, self.weight, self.dilation, self.groups) + self.bias


class CausalTransposedConv(nn.Module):
    """A transposed convolution of stride ``r`` and kernel ``r`` or ``2r``, its first and
    last ``kernel - r`` outputs cut as transformers cuts them. With kernel ``r``, frame
    ``t`` gives output block ``t`` (``r`` samples) alone; with kernel ``2r``, block ``t``
    is frame ``t - 1`` through the kernel's second half plus frame ``t`` through its
    first, so a frame's block is written once the next frame is known: the stream keeps
    the last frame. The weight is MLX's ``ConvTranspose1d`` layout, (out, kernel, in)."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int):
        super().__init__()
        if kernel not in (stride, 2 * stride):
            raise ValueError(f"a causal transposed convolution of kernel {kernel} and stride "
                             f"{stride} (only kernels of one or two strides)")
        self.weight = mx.zeros((out_channels, kernel, in_channels))
        self.bias = mx.zeros((out_channels,))
        self.stride = stride

    def __call__(self, x: mx.array, stream: Code2WavStream) -> mx.array:
        r = self.stride
        out, kernel, _ = self.weight.shape
        if kernel == 2 * r:
            before = stream.take(self)
            stream.keep(self, x[:, -1:])
            if before is not None:
                x = mx.concatenate([before, x], axis=1)
        batch, frames, _ = x.shape
        # every frame through every tap: (batch, frames, kernel, out); the weight is used
        # as stored (a transposed view in the product, no copy)
        taps = (x @ self.weight.reshape(out * kernel, -1).T).reshape(batch, frames, out, kernel)
        taps = taps.transpose(0, 1, 3, 2)
        if kernel == r:
            blocks = taps
        else:  # block t: frame t through the first r taps, frame t - 1 through the rest
            blocks = taps[:, 1:, :r] + taps[:, :-1, r:]
        return blocks.reshape(batch, -1, out) + self.bias


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = mx.ones((dim,))

    def __call__(self, x: mx.array, stream: Code2WavStream) -> mx.array:
        h = self.norm(self.dwconv(x, stream))
        h = self.pwconv2(nn.gelu(self.pwconv1(h)))
        return x + self.gamma * h


class UpsampleStage(nn.Module):
    """``upsample.i``: a transposed convolution (``0``), then a ConvNeXt block (``1``)."""

    def __init__(self, dim: int, factor: int):
        super().__init__()
        self.layers = [CausalTransposedConv(dim, dim, factor, factor), ConvNeXtBlock(dim)]

    def __call__(self, x, stream):
        for layer in self.layers:
            x = layer(x, stream)
        return x


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def __call__(self, x, stream):
        h = self.conv1(self.act1(x), stream)
        return x + self.conv2(self.act2(h), stream)


class DecoderBlock(nn.Module):
    """``decoder.i.block``: SnakeBeta, an upsampling transposed convolution, three
    residual units (dilations 1, 3, 9)."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = [SnakeBeta(in_dim), CausalTransposedConv(in_dim, out_dim, 2 * rate, rate)]
        self.block += [ResidualUnit(out_dim, d) for d in (1, 3, 9)]

    def __call__(self, x, stream):
        x = self.block[0](x)
        for part in self.block[1:]:
            x = part(x, stream)
        return x


class Attention(nn.Module):
    """Causal attention within ``sliding_window`` positions; the stream keeps the keys
    and values of the last ``window - 1`` positions."""

    def __init__(self, config: Code2WavConfig):
        super().__init__()
        dim, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, config.head_dim
        self.window = config.sliding_window
        self.theta = config.rope_theta
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=bias)

    def __call__(self, x: mx.array, stream: Code2WavStream) -> mx.array:
        batch, length, _ = x.shape
        offset = stream.frames

        def heads(projection, n):
            h = projection(x).reshape(batch, length, n, self.head_dim).transpose(0, 2, 1, 3)
            return h

        rope = dict(dims=self.head_dim, traditional=False, base=self.theta, scale=1.0,
                    offset=offset)
        queries = mx.fast.rope(heads(self.q_proj, self.heads), **rope)
        keys = mx.fast.rope(heads(self.k_proj, self.kv_heads), **rope)
        values = heads(self.v_proj, self.kv_heads)
        cached = stream.take(self)
        if cached is not None:
            keys = mx.concatenate([cached[0], keys], axis=2)
            values = mx.concatenate([cached[1], values], axis=2)
        keep = self.window - 1
        stream.keep(self, (keys[:, :, -keep:], values[:, :, -keep:]) if keep > 0 else None)
        query_pos = mx.arange(offset, offset + length)[:, None]
        key_pos = mx.arange(offset + length - keys.shape[2], offset + length)[None]
        distance = query_pos - key_pos
        mask = (distance >= 0) & (distance < self.window)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.head_dim**-0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = mx.ones((dim,))

    def __call__(self, x):
        return self.scale * x


class TransformerLayer(nn.Module):
    def __init__(self, config: Code2WavConfig):
        super().__init__()
        dim = config.hidden_size
        self.self_attn = Attention(config)
        self.mlp = MLP(dim, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(dim, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(dim)
        self.mlp_layer_scale = LayerScale(dim)

    def __call__(self, x, stream):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), stream))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.layers = [TransformerLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, stream):
        for layer in self.layers:
            x = layer(x, stream)
        return self.norm(x)


class Code2Wav(nn.Module):
    """``code2wav`` in checkpoints."""

    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.config = config
        self.code_embedding = nn.Embedding(config.codebook_size * config.num_quantizers,
                                           config.hidden_size)
        self.pre_transformer = PreTransformer(config)
        self.upsample = [UpsampleStage(config.hidden_size, f) for f in config.upsampling_ratios]
        rates = config.upsample_rates
        dims = [config.decoder_dim // 2**i for i in range(len(rates) + 1)]
        self.decoder = [CausalConv(config.hidden_size, config.decoder_dim, 7)]
        self.decoder += [DecoderBlock(dims[i], dims[i + 1], rate) for i, rate in enumerate(rates)]
        self.decoder += [SnakeBeta(dims[-1]), CausalConv(dims[-1], 1, 7)]

    def __call__(self, codes: mx.array, stream: Code2WavStream | None = None) -> mx.array:
        """``codes`` (batch, frames, groups) -> samples (batch, n), in [-1, 1]. With a
        ``stream``, the next frames of a waveform whose earlier frames went through the
        same stream: the samples continue the earlier ones exactly. One frame's last
        samples wait for the next frame (the transposed convolutions), so a waveform of
        ``T`` frames has fewer than ``T * samples_per_frame`` samples, as transformers'."""
        config = self.config
        if codes.ndim != 3 or codes.shape[2] != config.num_quantizers:
            raise ValueError(f"code2wav expects (batch, frames, {config.num_quantizers}) codes, "
                             f"got {tuple(codes.shape)}")
        stream = stream or Code2WavStream()
        offsets = mx.arange(config.num_quantizers) * config.codebook_size
        hidden = self.code_embedding(codes + offsets).mean(axis=2)
        hidden = self.pre_transformer(hidden, stream)
        stream.frames += codes.shape[1]
        for stage in self.upsample:
            hidden = stage(hidden, stream)
        wav = hidden
        for part in self.decoder:
            wav = part(wav) if isinstance(part, SnakeBeta) else part(wav, stream)
        return mx.clip(wav[..., 0], -1.0, 1.0)

    @staticmethod
    def sanitize(name: str, value: mx.array) -> mx.array | None:
        """A Hugging Face tensor (``name`` after ``code2wav.``) in this module's layout:
        convolution weights (out, in, k) -> (out, k, in), transposed ones (in, out, k) ->
        (out, k, in); names of the wrapped convolutions and stage lists as here."""
        if name.endswith("code_offset") or name.endswith("inv_freq"):
            return None
        if not name.endswith("conv.weight") or value.ndim != 3:
            return value
        if _is_transposed_conv(name):
            return value.transpose(1, 2, 0)
        return value.transpose(0, 2, 1)

    @staticmethod
    def hf_to_mlx_name(name: str) -> str:
        """``upsample.i.j.*`` -> ``upsample.i.layers.j.*``; ``*.conv.weight`` -> ``*.weight``
        (the wrapped ``nn.Conv1d``)."""
        parts = name.split(".")
        if parts[0] == "upsample":
            parts.insert(2, "layers")
        name = ".".join(parts)
        return name.replace(".conv.weight", ".weight").replace(".conv.bias", ".bias")


def _is_transposed_conv(name: str) -> bool:
    """``upsample.i.0.conv`` and ``decoder.i.block.1.conv`` are the transposed ones."""
    parts = name.split(".")
    return ((parts[0] == "upsample" and parts[2] == "0")
            or (parts[0] == "decoder" and len(parts) > 3 and parts[2] == "block"
                and parts[3] == "1"))
