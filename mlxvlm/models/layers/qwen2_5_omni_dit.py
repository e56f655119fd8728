"""Qwen2.5-Omni's token2wav, part one: codec codes -> a mel spectrogram, by a diffusion
transformer (DiT) integrated from noise by a fixed-step ODE solver, as transformers'
``Qwen2_5OmniToken2WavDiTModel.sample``:

- the voice: an ECAPA-TDNN speaker encoder over the voice's reference mel (reflect-padded
  dilated convolutions, Res2Net and squeeze-excitation blocks, attentive statistics
  pooling), beside the voice's conditioning vector;
- each step's input: the noisy mel, the speaker encoding, the codes' embeddings (each
  code repeated ``repeats`` times) and the conditioning vector, projected together;
- DiT blocks modulated by the time step (adaptive layer norms), attention within blocks
  of ``block_size`` frames (some layers also one block back or ahead), the rotary
  embedding on the first head only, interleaved, as the checkpoint was trained;
- classifier-free guidance (the unconditioned branch: no voice, codes all 0) and a
  "sway" warp of the time points, integrated by the Runge-Kutta 3/8 rule.

Layouts are MLX's (time before channels); ``Token2Wav.sanitize`` turns PyTorch's
convolution weights into them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models.config_utils import rope_parameters
from mlxvlm.models.layers.conv1d_products import shifted_products


@dataclass(frozen=True)
class DiTConfig:
    hidden_size: int = 1024
    num_hidden_layers: int = 22
    num_attention_heads: int = 16
    ff_mult: int = 2
    emb_dim: int = 512
    head_dim: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    block_size: int = 24
    look_ahead_layers: tuple[int, ...] = (10,)
    look_backward_layers: tuple[int, ...] = (0, 20)
    repeats: int = 2
    num_embeds: int = 8193
    mel_dim: int = 80
    enc_emb_dim: int = 192
    enc_dim: int = 128
    enc_channels: tuple[int, ...] = (256, 256, 256, 256, 768)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 64
    enc_res2net_scale: int = 2
    enc_se_channels: int = 64

    @classmethod
    def from_hf(cls, config: dict) -> "DiTConfig":
        fields = {k: config[k] for k in cls.__dataclass_fields__ if k in config}
        for key, value in fields.items():
            if isinstance(value, list):
                fields[key] = tuple(value)
        fields["rope_theta"] = rope_parameters(config, 10000.0)["rope_theta"]
        return cls(**fields)


class Conv(nn.Module):
    """A stride-1 convolution padded ``left``/``right`` with zeros or by reflection."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, dilation: int = 1,
                 padding: tuple[int, int] | None = None, reflect: bool = False,
                 bias: bool = True):
        super().__init__()
        self.weight = mx.zeros((out_channels, kernel, in_channels))
        if bias:
            self.bias = mx.zeros((out_channels,))
        self.dilation = dilation
        total = dilation * (kernel - 1)
        self.padding = padding if padding is not None else (total // 2, total - total // 2)
        self.reflect = reflect

    def __call__(self, x: mx.array) -> mx.array:
        left, right = self.padding
        if self.reflect:
            x = mx.concatenate([x[:, left:0:-1], x, x[:, -2:-2 - right:-1]], axis=1)
        elif left or right:
            x = mx.pad(x, [(0, 0), (left, right), (0, 0)])
        y = shifted_products(x, self.weight, self.dilation)
        return y + self.bias if "bias" in self else y


class TimeDelayNetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = Conv(in_channels, out_channels, kernel, dilation, reflect=True)

    def __call__(self, x):
        return nn.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = [TimeDelayNetBlock(width, width, kernel, dilation) for _ in range(scale - 1)]

    def __call__(self, x):
        parts = mx.split(x, self.scale, axis=-1)
        outputs = [parts[0]]
        for i in range(1, self.scale):
            h = parts[i] if i == 1 else parts[i] + outputs[-1]
            outputs.append(self.blocks[i - 1](h))
        return mx.concatenate(outputs, axis=-1)


class SqueezeExcitationBlock(nn.Module):
    def __init__(self, in_channels: int, se_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = Conv(in_channels, se_channels, 1, reflect=True)
        self.conv2 = Conv(se_channels, out_channels, 1, reflect=True)

    def __call__(self, x):
        s = mx.sigmoid(self.conv2(nn.relu(self.conv1(x.mean(axis=1, keepdims=True)))))
        return x * s


class SqueezeExcitationRes2NetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, scale: int, se_channels: int,
                 kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(in_channels, out_channels, 1, 1)
        self.res2net_block = Res2NetBlock(out_channels, scale, kernel, dilation)
        self.tdnn2 = TimeDelayNetBlock(out_channels, out_channels, 1, 1)
        self.se_block = SqueezeExcitationBlock(out_channels, se_channels, out_channels)

    def __call__(self, x):
        h = self.tdnn2(self.res2net_block(self.tdnn1(x)))
        return self.se_block(h) + x


def _statistics(x: mx.array, weights: mx.array, eps: float = 1e-12):
    """Weighted mean and standard deviation over time: (batch, channels) each."""
    mean = (weights * x).sum(axis=1)
    std = mx.sqrt(mx.maximum((weights * mx.square(x - mean[:, None])).sum(axis=1), eps))
    return mean, std


class AttentiveStatisticsPooling(nn.Module):
    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = Conv(attention_channels, channels, 1, reflect=True)

    def __call__(self, x):
        length = x.shape[1]
        mean, std = _statistics(x, mx.full((1, length, 1), 1.0 / length, x.dtype))
        context = mx.concatenate([x, mx.broadcast_to(mean[:, None], x.shape),
                                  mx.broadcast_to(std[:, None], x.shape)], axis=-1)
        attention = mx.softmax(self.conv(mx.tanh(self.tdnn(context))), axis=1, precise=True)
        mean, std = _statistics(x, attention)
        return mx.concatenate([mean, std], axis=-1)[:, None]


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN (``input_embed.spk_encoder``): a mel (batch, frames, mel) -> (batch,
    enc_dim)."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        channels, kernels, dilations = (config.enc_channels, config.enc_kernel_sizes,
                                        config.enc_dilations)
        if not len(channels) == len(kernels) == len(dilations):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations differ in length")
        self.blocks = [TimeDelayNetBlock(config.mel_dim, channels[0], kernels[0], dilations[0])]
        self.blocks += [
            SqueezeExcitationRes2NetBlock(channels[i - 1], channels[i], config.enc_res2net_scale,
                                          config.enc_se_channels, kernels[i], dilations[i])
            for i in range(1, len(channels) - 1)
        ]
        self.mfa = TimeDelayNetBlock(channels[-1], channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentiveStatisticsPooling(channels[-1], config.enc_attention_channels)
        self.fc = Conv(channels[-1] * 2, config.enc_dim, 1, reflect=True)

    def __call__(self, mel: mx.array) -> mx.array:
        h = mel
        outputs = []
        for block in self.blocks:
            h = block(h)
            outputs.append(h)
        h = self.mfa(mx.concatenate(outputs[1:], axis=-1))
        return self.fc(self.asp(h))[:, 0]


class InputEmbedding(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        width = config.mel_dim + config.enc_dim + config.enc_emb_dim + config.emb_dim
        self.proj = nn.Linear(width, config.hidden_size)
        self.spk_encoder = SpeakerEncoder(config)


class CodecEmbedding(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        self.repeats = config.repeats
        self.codec_embed = nn.Embedding(config.num_embeds + 1, config.emb_dim)

    def __call__(self, codes: mx.array) -> mx.array:
        return mx.repeat(self.codec_embed(codes), self.repeats, axis=1)


class TimestepEmbedding(nn.Module):
    """A sinusoidal embedding of the time step (x1000), then Linear, SiLU, Linear."""

    def __init__(self, dim: int, frequency_dim: int = 256):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.time_mlp = [nn.Linear(frequency_dim, dim), nn.SiLU(), nn.Linear(dim, dim)]

    def __call__(self, t: mx.array) -> mx.array:
        half = self.frequency_dim // 2
        scale = math.log(10000) / (half - 1)
        angles = 1000 * t[:, None] * mx.exp(mx.arange(half, dtype=mx.float32) * -scale)[None]
        h = mx.concatenate([mx.sin(angles), mx.cos(angles)], axis=-1)
        for layer in self.time_mlp:
            h = layer(h)
        return h


def _layer_norm(x: mx.array) -> mx.array:
    return mx.fast.layer_norm(x, None, None, 1e-6)


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, dim * chunks)

    def __call__(self, t: mx.array) -> list[mx.array]:
        return [c[:, None] for c in mx.split(self.linear(nn.silu(t)), self.chunks, axis=-1)]


class Attention(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        inner = config.head_dim * config.num_attention_heads
        self.heads, self.head_dim, self.theta = config.num_attention_heads, config.head_dim, config.rope_theta
        self.to_q = nn.Linear(config.hidden_size, inner)
        self.to_k = nn.Linear(config.hidden_size, inner)
        self.to_v = nn.Linear(config.hidden_size, inner)
        self.to_out = [nn.Linear(inner, config.hidden_size)]

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        batch, length, _ = x.shape

        def heads(projection):
            return projection(x).reshape(batch, length, self.heads, self.head_dim).transpose(0, 2, 1, 3)

        def rotate_first_head(h):
            first = mx.fast.rope(h[:, :1], self.head_dim, traditional=True, base=self.theta,
                                 scale=1.0, offset=0)
            return mx.concatenate([first, h[:, 1:]], axis=1)

        q, k, v = rotate_first_head(heads(self.to_q)), rotate_first_head(heads(self.to_k)), heads(self.to_v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask=mask)
        return self.to_out[0](out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        # transformers' indices: Linear, GELU (tanh), Dropout, Linear
        self.ff = [nn.Linear(dim, dim * mult), nn.GELU(approx="tanh"), nn.Identity(),
                   nn.Linear(dim * mult, dim)]

    def __call__(self, x):
        return self.ff[3](self.ff[1](self.ff[0](x)))


class DiTBlock(nn.Module):
    def __init__(self, config: DiTConfig, look_ahead: int, look_back: int):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(config.hidden_size, 6)
        self.attn = Attention(config)
        self.ff = FeedForward(config.hidden_size, config.ff_mult)
        self.look_ahead, self.look_back = look_ahead, look_back

    def __call__(self, x, t, block_diff):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(t)
        mask = (block_diff >= -self.look_back) & (block_diff <= self.look_ahead)
        x = x + gate_msa * self.attn(_layer_norm(x) * (1 + scale_msa) + shift_msa, mask)
        return x + gate_mlp * self.ff(_layer_norm(x) * (1 + scale_mlp) + shift_mlp)


class DiT(nn.Module):
    """``token2wav.code2wav_dit_model``."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.config = config
        self.time_embed = TimestepEmbedding(config.hidden_size)
        self.text_embed = CodecEmbedding(config)
        self.input_embed = InputEmbedding(config)
        self.transformer_blocks = [
            DiTBlock(config, int(i in config.look_ahead_layers), int(i in config.look_backward_layers))
            for i in range(config.num_hidden_layers)
        ]
        self.norm_out = AdaLayerNormZero(config.hidden_size, 2)
        self.proj_out = nn.Linear(config.hidden_size, config.mel_dim)

    def __call__(self, x: mx.array, t: mx.array, conditions: mx.array) -> mx.array:
        """The velocity at mel ``x`` (batch, frames, mel) and time ``t`` (batch,), given
        the ``conditions`` (batch, frames, speaker + codes + conditioning widths) of each
        batch row."""
        h = self.input_embed.proj(mx.concatenate([x, conditions], axis=-1))
        time = self.time_embed(t)
        blocks = mx.arange(h.shape[1]) // self.config.block_size
        block_diff = blocks[None] - blocks[:, None]
        for block in self.transformer_blocks:
            h = block(h, time, block_diff)
        scale, shift = self.norm_out(time)
        return self.proj_out(_layer_norm(h) * (1 + scale) + shift)

    def conditions(self, codes: mx.array, conditioning: mx.array, reference_mel: mx.array,
                   guided: bool) -> mx.array:
        """Each frame's conditions (everything but the noisy mel): the speaker encoding
        of ``reference_mel``, the codes' embeddings and ``conditioning``; with guidance, a
        second row without the voice and with codes 0 (the unconditioned branch)."""
        frames = codes.shape[1] * self.config.repeats
        if guided:
            reference_mel = mx.concatenate([reference_mel, mx.zeros_like(reference_mel)])
            conditioning = mx.concatenate([conditioning, mx.zeros_like(conditioning)])
            codes = mx.concatenate([codes, mx.zeros_like(codes)])
        speaker = self.input_embed.spk_encoder(reference_mel)
        rows = speaker.shape[0]

        def per_frame(v):
            return mx.broadcast_to(v[:, None], (rows, frames, v.shape[-1]))

        return mx.concatenate([per_frame(speaker), self.text_embed(codes), per_frame(conditioning)],
                              axis=-1)

    def sample(self, codes: mx.array, conditioning: mx.array, reference_mel: mx.array,
               noise: mx.array | None = None, num_steps: int = 10, guidance_scale: float = 0.5,
               sway_coefficient: float | None = -1.0, seed: int = 0) -> mx.array:
        """The mel (1, frames x repeats, mel_dim) of ``codes`` (1, frames) in the voice
        given by ``conditioning`` (1, enc_emb_dim) and ``reference_mel`` (1, T, mel_dim),
        integrated from ``noise`` (1, frames x repeats, mel_dim; None: drawn from
        ``seed``, so that the same codes always sound the same)."""
        config = self.config
        frames = codes.shape[1] * config.repeats
        if frames > config.max_position_embeddings:
            raise ValueError(f"{codes.shape[1]} codes make {frames} mel frames, more than the "
                             f"DiT's {config.max_position_embeddings}")
        if noise is None:
            noise = mx.random.normal((1, frames, config.mel_dim), key=mx.random.key(seed))
        guided = guidance_scale >= 1e-5
        conditions = self.conditions(codes, conditioning, reference_mel, guided)

        def velocity(t: np.float32, y: mx.array) -> mx.array:
            if not guided:
                return self(y, mx.full((1,), t, mx.float32), conditions)
            out = self(mx.concatenate([y, y]), mx.full((2,), t, mx.float32), conditions)
            return out[:1] + (out[:1] - out[1:]) * guidance_scale

        return runge_kutta_38(velocity, noise, time_points(num_steps, sway_coefficient))


def time_points(num_steps: int, sway_coefficient: float | None) -> np.ndarray:
    """``num_steps`` times from 0 to 1 in float32, warped by the sway coefficient."""
    t = np.linspace(0, 1, num_steps, dtype=np.float32)
    if sway_coefficient is not None:
        t = t + np.float32(sway_coefficient) * (np.cos(np.float32(np.pi / 2) * t) - 1 + t)
    return t.astype(np.float32)


def runge_kutta_38(velocity, y: mx.array, times: np.ndarray) -> mx.array:
    """``y`` carried from ``times[0]`` to ``times[-1]``, one step of the 3/8 rule per
    interval (transformers' ``RungeKutta4ODESolver``)."""
    third = np.float32(1 / 3)
    for t0, t1 in zip(times[:-1], times[1:]):
        dt = np.float32(t1 - t0)
        k1 = velocity(t0, y)
        k2 = velocity(np.float32(t0 + dt * third), y + dt * k1 * third)
        k3 = velocity(np.float32(t0 + dt * np.float32(2 / 3)), y + dt * (k2 - k1 * third))
        k4 = velocity(t1, y + dt * (k1 - k2 + k3))
        y = y + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        mx.eval(y)
    return y
