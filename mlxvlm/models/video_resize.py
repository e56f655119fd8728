"""Resizing uint8 video frames as torchvision does on the CPU, in numpy: the step every
transformers video processor starts with, which mlxvlm's numpy video processors share."""

from __future__ import annotations

import numpy as np

BICUBIC = 3  # PIL's (and transformers' PILImageResampling) number for bicubic



def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    """Keys' cubic convolution kernel with a = -0.5 (PIL's and torch's antialiased one)."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _lanczos(x: np.ndarray, a: float = 3.0) -> np.ndarray:
    """Lanczos' windowed sinc with three lobes (PIL's and torch's)."""
    return np.where(np.abs(x) < a, np.sinc(x) * np.sinc(x / a), 0.0)


# filter name -> (kernel, support in input pixels at scale 1)
FILTERS = {"bicubic": (_cubic, 2.0), "lanczos": (_lanczos, 3.0)}


def _int16_taps(in_size: int, out_size: int, kernel=_cubic,
                base_support: float = 2.0) -> tuple[np.ndarray, np.ndarray, int]:
    """For each output pixel: the first input pixel, the integer weights of its taps, and
    the weights' fixed-point precision — torch's uint8 antialiased resampling, which
    widens the filter by the scale when downscaling and keeps weights in int16."""
    scale = in_size / out_size
    support = base_support * scale if scale >= 1.0 else base_support
    taps = int(np.ceil(support)) * 2 + 1
    inv_scale = 1.0 / scale if scale >= 1.0 else 1.0
    centers = scale * (np.arange(out_size) + 0.5)
    first = np.maximum((centers - support + 0.5).astype(np.int64), 0)
    last = np.minimum((centers + support + 0.5).astype(np.int64), in_size)
    count = np.clip(last - first, 0, taps)
    offsets = np.arange(taps)
    weights = kernel((offsets[None, :] + first[:, None] - centers[:, None] + 0.5) * inv_scale)
    weights = np.where(offsets[None, :] < count[:, None], weights, 0.0)
    totals = weights.sum(axis=1, keepdims=True)
    weights = np.divide(weights, totals, out=np.zeros_like(weights), where=totals != 0)
    # The largest precision whose weights still fit in int16 (torch's choice).
    largest = weights.max()
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    fixed = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5))
    return first, fixed.astype(np.int32), precision


def _resample_axis(pixels: np.ndarray, out_size: int, axis: int,
                   filter_name: str = "bicubic") -> np.ndarray:
    """One separable pass along ``axis`` of uint8 ``pixels``, rounded back to uint8."""
    in_size = pixels.shape[axis]
    first, weights, precision = _int16_taps(in_size, out_size, *FILTERS[filter_name])
    source = np.moveaxis(pixels, axis, -1).astype(np.int32)
    padded = np.concatenate(
        [source, np.zeros(source.shape[:-1] + (weights.shape[1],), np.int32)], axis=-1
    )
    total = np.full(source.shape[:-1] + (out_size,), 1 << (precision - 1), np.int64)
    for tap in range(weights.shape[1]):
        total += padded[..., first + tap] * weights[:, tap]
    result = np.clip(total >> precision, 0, 255).astype(np.uint8)
    return np.moveaxis(result, -1, axis)


def resize_uint8(frames: np.ndarray, height: int, width: int,
                 filter_name: str = "bicubic") -> np.ndarray:
    """Resize uint8 frames (..., H, W, C) as torchvision resizes uint8 tensors on the CPU
    (``antialias=True``, bicubic or lanczos): the width first, then the height, each pass
    in integer arithmetic with int16 weights and rounded to uint8 — bit for bit the same
    pixels."""
    if frames.shape[-3:-1] == (height, width):
        return frames
    if frames.shape[-2] != width:
        frames = _resample_axis(frames, width, frames.ndim - 2, filter_name)
    if frames.shape[-3] != height:
        frames = _resample_axis(frames, height, frames.ndim - 3, filter_name)
    return frames


def resize_bicubic_uint8(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """:func:`resize_uint8` with the bicubic filter."""
    return resize_uint8(frames, height, width, "bicubic")
