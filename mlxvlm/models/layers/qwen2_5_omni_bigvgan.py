"""Qwen2.5-Omni's token2wav, part two: BigVGAN, a mel spectrogram -> 24 kHz samples, as
transformers' ``Qwen2_5OmniToken2WavBigVGANModel``: the mel scaled to decibels in
[-1, 1], a convolution, then per stage a transposed convolution and the mean of AMP
blocks (dilated convolutions between anti-aliased SnakeBeta activations: upsampled 2x
by a Kaiser-windowed sinc, activated, filtered and downsampled back), a last activation
and convolution, clipped to [-1, 1].

The convolutions run as matrix products over shifted views
(``layers/conv1d_products.py``); the anti-aliasing filters, one filter shared by every
channel, as weighted sums of views split by phase. Layouts are MLX's (time before
channels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models.layers.conv1d_products import SnakeBeta, transposed_products
from mlxvlm.models.layers.qwen2_5_omni_dit import Conv

RESAMPLE_KERNEL = 12  # the anti-aliasing filters' taps, 2x up and down


@dataclass(frozen=True)
class BigVGANConfig:
    mel_dim: int = 80
    upsample_initial_channel: int = 1536
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    upsample_rates: tuple[int, ...] = (5, 3, 2, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (11, 7, 4, 4, 4, 4)

    @classmethod
    def from_hf(cls, config: dict) -> "BigVGANConfig":
        fields = {k: config[k] for k in cls.__dataclass_fields__ if k in config}
        for key, value in fields.items():
            if isinstance(value, list):
                fields[key] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        return cls(**fields)

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates)


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel: int) -> np.ndarray:
    """A low-pass filter: a sinc windowed by Kaiser's window, summing to 1 (float32)."""
    half = kernel // 2
    attenuation = 2.285 * (half - 1) * math.pi * 4 * half_width + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = np.kaiser(kernel, beta).astype(np.float32)
    times = (np.arange(-half, half) + 0.5) if kernel % 2 == 0 else (np.arange(kernel) - half)
    taps = 2 * cutoff * window * np.sinc(2 * cutoff * times.astype(np.float32))
    taps = taps.astype(np.float32)
    return taps / taps.sum()


def _edge_pad(x: mx.array, left: int, right: int) -> mx.array:
    return mx.concatenate([mx.repeat(x[:, :1], left, axis=1), x,
                           mx.repeat(x[:, -1:], right, axis=1)], axis=1)


def _weighted_views(x: mx.array, taps, length: int) -> mx.array:
    """sum_j taps[j] * x[:, j : j + length]."""
    y = x[:, :length] * float(taps[0])
    for j in range(1, len(taps)):
        y = y + x[:, j:j + length] * float(taps[j])
    return y


class AntiAliasedSnake(nn.Module):
    """SnakeBeta at twice the rate: upsampled 2x (a transposed convolution by the filter,
    edges replicated), activated, low-passed and downsampled 2x by the same filter."""

    def __init__(self, channels: int):
        super().__init__()
        self.act = SnakeBeta(channels)
        self._filter = kaiser_sinc_filter(0.25, 0.3, RESAMPLE_KERNEL)

    def __call__(self, x: mx.array) -> mx.array:
        return self._down(self.act(self._up(x)))

    def _up(self, x: mx.array) -> mx.array:
        k = RESAMPLE_KERNEL
        pad = k // 2 - 1
        length = x.shape[1]
        x = _edge_pad(x, pad, pad)
        # output 2m + p = sum_i x[m - i] * f[2i + p]: per phase, a correlation with the
        # phase's taps reversed over x padded by zeros
        x = mx.pad(x, [(0, 0), (k // 2 - 1, k // 2 - 1), (0, 0)])
        full = length + 2 * pad + k // 2 - 1
        phases = [_weighted_views(x, 2 * self._filter[p::2][::-1], full) for p in (0, 1)]
        y = mx.stack(phases, axis=2).reshape(x.shape[0], 2 * full, x.shape[2])
        cut = pad * 2 + (k - 2) // 2
        return y[:, cut:cut + 2 * length]

    def _down(self, x: mx.array) -> mx.array:
        k = RESAMPLE_KERNEL
        x = _edge_pad(x, k // 2 - 1, k // 2)
        length = (x.shape[1] - k) // 2 + 1
        if x.shape[1] % 2:
            x = mx.pad(x, [(0, 0), (0, 1), (0, 0)])
        pairs = x.reshape(x.shape[0], -1, 2, x.shape[2])
        even, odd = pairs[:, :, 0], pairs[:, :, 1]
        return (_weighted_views(even, self._filter[0::2], length)
                + _weighted_views(odd, self._filter[1::2], length))


class AMPBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = [Conv(channels, channels, kernel, d) for d in dilations]
        self.convs2 = [Conv(channels, channels, kernel, 1) for _ in dilations]
        self.activations = [AntiAliasedSnake(channels) for _ in range(2 * len(dilations))]

    def __call__(self, x: mx.array) -> mx.array:
        for i, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2)):
            h = conv1(self.activations[2 * i](x))
            x = x + conv2(self.activations[2 * i + 1](h))
        return x


class TransposedConv(nn.Module):
    """PyTorch's ``ConvTranspose1d(kernel, stride, padding)``; weight (out, kernel, in)."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int):
        super().__init__()
        self.weight = mx.zeros((out_channels, kernel, in_channels))
        self.bias = mx.zeros((out_channels,))
        self.stride, self.padding = stride, (kernel - stride) // 2

    def __call__(self, x: mx.array) -> mx.array:
        y = transposed_products(x, self.weight, self.stride)
        p = self.padding
        return y[:, p:y.shape[1] - p] + self.bias


class BigVGAN(nn.Module):
    """``token2wav.code2wav_bigvgan_model``."""

    def __init__(self, config: BigVGANConfig):
        super().__init__()
        self.config = config
        width = config.upsample_initial_channel
        self.conv_pre = Conv(config.mel_dim, width, 7)
        self.ups = [[TransposedConv(width // 2**i, width // 2**(i + 1), k, s)]
                    for i, (s, k) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes))]
        self.resblocks = [AMPBlock(width // 2**(i + 1), k, tuple(d))
                          for i in range(len(config.upsample_rates))
                          for k, d in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes)]
        last = width // 2**len(config.upsample_rates)
        self.activation_post = AntiAliasedSnake(last)
        self.conv_post = Conv(last, 1, 7, bias=False)

    def __call__(self, mel: mx.array) -> mx.array:
        """``mel`` (batch, frames, mel_dim), natural-log amplitudes -> samples (batch, n)."""
        min_level = math.exp(-115 / 20 * math.log(10))
        decibels = 20 * mx.log10(mx.maximum(mx.exp(mel), min_level)) - 20
        h = self.conv_pre(mx.clip(2 * ((decibels + 115) / 115) - 1, -1, 1))
        per_stage = len(self.config.resblock_kernel_sizes)
        for i, (up,) in enumerate(self.ups):
            h = up(h)
            blocks = self.resblocks[i * per_stage:(i + 1) * per_stage]
            total = blocks[0](h)
            for block in blocks[1:]:
                total = total + block(h)
            h = total / per_stage
            mx.eval(h)
        out = self.conv_post(self.activation_post(h))
        return mx.clip(out[..., 0], -1.0, 1.0)
