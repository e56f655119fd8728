"""Antialiased bilinear resizing of 8-bit images as PyTorch computes it on the CPU
(``F.interpolate(mode="bilinear", antialias=True)`` on uint8, which torchvision's
``resize`` runs): separable, the horizontal pass first, each pass with fixed-point int16
weights whose precision is chosen per axis, rounded and clamped to 8 bits in between.
PIL's bilinear filter is the same but with other fixed-point weights, so its pixels can
differ from torchvision's by one level; processors that transformers only ships for
torchvision resize with this instead, to give the pixels transformers gives.
"""

from __future__ import annotations

import numpy as np


def axis_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(first, weights, precision)``: for each output pixel, the first input pixel it
    reads and its int weights over the next ``weights.shape[1]`` ones (zero past the
    filter), scaled by ``2**precision``."""
    scale = in_size / out_size
    support = scale if scale >= 1.0 else 1.0  # the triangle filter's, widened to downscale
    inverse = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(np.ceil(support)) * 2 + 1
    first = np.zeros(out_size, dtype=np.int64)
    weights = np.zeros((out_size, taps), dtype=np.float64)
    for i in range(out_size):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        w = np.maximum(0.0, 1.0 - np.abs((np.arange(lo, hi) - center + 0.5) * inverse))
        total = w.sum()
        first[i] = lo
        weights[i, : hi - lo] = w / total if total != 0.0 else w
    largest = weights.max()
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    fixed = np.where(scaled < 0, -0.5 + scaled, 0.5 + scaled).astype(np.int64)  # C's (int)
    return first, fixed, precision


def _resize_last_axis(image: np.ndarray, out_size: int) -> np.ndarray:
    in_size = image.shape[-1]
    first, fixed, precision = axis_taps(in_size, out_size)
    # int32 is exact: the weights sum to about 2**precision < 2**16, times 255
    total = np.full(image.shape[:-1] + (out_size,), 1 << (precision - 1), dtype=np.int32)
    for tap in range(fixed.shape[1]):  # one tap at a time: memory of one output
        index = np.minimum(first + tap, in_size - 1)
        total += image[..., index].astype(np.int32) * fixed[:, tap].astype(np.int32)
    return np.clip(total >> precision, 0, 255).astype(np.uint8)


def resize_uint8(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """A (C, H, W) uint8 image resized to (C, height, width)."""
    if image.shape[-1] != width:
        image = _resize_last_axis(image, width)
    if image.shape[-2] != height:
        image = _resize_last_axis(image.swapaxes(-1, -2), height).swapaxes(-1, -2)
    return np.ascontiguousarray(image)
