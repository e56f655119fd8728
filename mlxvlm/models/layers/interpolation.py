"""PyTorch's ``F.interpolate`` on float tables as (out, in) weight matrices, for towers
whose learned tables transformers resizes to another input size (SAM's position table
and relative-position tables). A resize along one axis is ``matrix @ table``.

The source coordinates and weights are computed in float32, as PyTorch computes them for
float32 tensors (in float64 the weights differ by up to 1e-6 of the table's scale)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mlxvlm.models.video_resize import FILTERS

f32 = np.float32


@lru_cache(maxsize=32)  # a tower asks for the same sizes every view
def bicubic_antialiased_matrix(in_size: int, out_size: int) -> np.ndarray:
    """``mode="bicubic", align_corners=False, antialias=True``: Keys' cubic (a = -0.5)
    widened by the scale when downsizing, each row's weights normalized."""
    kernel, base_support = FILTERS["bicubic"]
    scale = f32(in_size) / f32(out_size)
    support = f32(base_support) * scale if scale >= 1.0 else f32(base_support)
    inv_scale = f32(1.0) / scale if scale >= 1.0 else f32(1.0)
    matrix = np.zeros((out_size, in_size), f32)
    for i in range(out_size):
        center = scale * (f32(i) + f32(0.5))
        first = max(int(center - support + f32(0.5)), 0)
        last = min(int(center + support + f32(0.5)), in_size)
        taps = np.arange(first, last).astype(f32)
        weights = kernel((taps - center + f32(0.5)) * inv_scale).astype(f32)
        total = weights.sum(dtype=f32)
        matrix[i, first:last] = weights / total if total != 0 else f32(0.0)
    matrix.flags.writeable = False  # shared by every caller (cached)
    return matrix


@lru_cache(maxsize=32)  # a tower asks for the same sizes every view
def linear_matrix(in_size: int, out_size: int) -> np.ndarray:
    """``mode="linear", align_corners=False`` (no antialiasing)."""
    scale = f32(in_size) / f32(out_size)
    matrix = np.zeros((out_size, in_size), f32)
    for i in range(out_size):
        source = max(f32(scale * f32(i + 0.5) - f32(0.5)), f32(0.0))
        low = int(source)
        high = low + 1 if low < in_size - 1 else low
        frac = f32(source - low)
        matrix[i, low] += f32(1.0) - frac
        matrix[i, high] += frac
    matrix.flags.writeable = False  # shared by every caller (cached)
    return matrix
