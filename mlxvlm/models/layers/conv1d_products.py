"""1-D convolutions as matrix products over shifted views, and the SnakeBeta activation:
what the speech decoders (Qwen3-Omni's code2wav, Qwen2.5-Omni's token2wav) are built of.

MLX's CPU ``conv1d`` is ~100x slower on these shapes (dilated ones most) than one matrix
product over the kernel's taps side by side. Layouts are MLX's: (batch, time, channels),
weights (out, kernel, in / groups)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def shifted_products(x: mx.array, weight: mx.array, dilation: int = 1, groups: int = 1) -> mx.array:
    """A valid (unpadded) stride-1 convolution as the kernel's taps over shifted views:
    one matrix product over the taps side by side, or, depthwise, a weighted sum of the
    views."""
    out_channels, kernel, per_group = weight.shape
    length = x.shape[1] - (kernel - 1) * dilation
    views = [x[:, j * dilation: j * dilation + length] for j in range(kernel)]
    if groups == 1:
        taps = mx.concatenate(views, axis=-1) if kernel > 1 else views[0]
        return taps @ weight.reshape(out_channels, kernel * per_group).T
    if groups != x.shape[-1] or per_group != 1 or out_channels != groups:
        raise NotImplementedError("grouped convolutions other than depthwise")
    y = views[0] * weight[:, 0, 0]
    for j in range(1, kernel):
        y = y + views[j] * weight[:, j, 0]
    return y


def transposed_products(x: mx.array, weight: mx.array, stride: int) -> mx.array:
    """A transposed convolution of any kernel and ``stride``, uncut: (batch, (T - 1) *
    stride + kernel, out). Every frame goes through every tap in one product; tap ``j``
    of frame ``t`` lands on output ``t * stride + j``, so the taps, grouped by whole
    strides, are added shifted by one frame per group. ``weight``: (out, kernel, in)."""
    out, kernel, _ = weight.shape
    batch, frames, _ = x.shape
    groups = -(-kernel // stride)
    taps = (x @ weight.reshape(out * kernel, -1).T).reshape(batch, frames, out, kernel)
    taps = taps.transpose(0, 1, 3, 2)  # (batch, frames, kernel, out)
    if groups * stride > kernel:
        taps = mx.pad(taps, [(0, 0), (0, 0), (0, groups * stride - kernel), (0, 0)])
    blocks = mx.zeros((batch, frames + groups - 1, stride, out), x.dtype)
    for g in range(groups):
        part = taps[:, :, g * stride:(g + 1) * stride]
        blocks = blocks + mx.pad(part, [(0, 0), (g, groups - 1 - g), (0, 0), (0, 0)])
    full = blocks.reshape(batch, -1, out)
    return full[:, : (frames - 1) * stride + kernel]


class SnakeBeta(nn.Module):
    """x + sin²(x e^α) / e^β, per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = mx.zeros((channels,))
        self.beta = mx.zeros((channels,))

    def __call__(self, x: mx.array) -> mx.array:
        alpha, beta = mx.exp(self.alpha), mx.exp(self.beta)
        return x + (1.0 / (beta + 1e-9)) * mx.square(mx.sin(x * alpha))
