"""AnyRes (LLaVA-NeXT, LLaVA-OneVision): high-resolution images as a grid of tiles.

The image processor resizes an image to the best-fitting resolution of
``image_grid_pinpoints`` (padding the rest), cuts it into tiles of the vision tower's
input size and puts a downscaled view of the whole image first. After the tower, the
tiles' feature maps are stitched back into one map, the padding rows or columns are cut
off again (unpadding), optionally downsampled (OneVision's ``anyres_max_N``), and a
learned ``image_newline`` embedding ends every row.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np


def best_resolution(image_size: Sequence[int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) of ``pinpoints`` the image processor resized ``image_size``
    (height, width) to: transformers' own choice, so that both sides agree."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution(tuple(int(s) for s in image_size), pinpoints)
    return int(height), int(width)


def tile_grid(image_size: Sequence[int], pinpoints, tile_size: int) -> tuple[int, int]:
    """(rows, columns) of tiles the image was cut into."""
    height, width = best_resolution(image_size, pinpoints)
    return height // tile_size, width // tile_size


def num_tiles(image_size: Sequence[int], pinpoints, tile_size: int) -> int:
    """Tiles the processor made for the image, the downscaled overview included."""
    rows, columns = tile_grid(image_size, pinpoints, tile_size)
    return rows * columns + 1


def stitch_tiles(tiles: mx.array, rows: int, columns: int, side: int) -> mx.array:
    """(rows * columns, side * side, dim) tile features -> one (rows * side,
    columns * side, dim) map, row-major like the image they came from."""
    grid = tiles.reshape(rows, columns, side, side, -1).transpose(0, 2, 1, 3, 4)
    return grid.reshape(rows * side, columns * side, -1)


def unpad(features: mx.array, original_size: Sequence[int]) -> mx.array:
    """Cut the rows (or columns) of a (height, width, dim) map that cover the padding the
    processor added around an image of ``original_size`` (height, width)."""
    original_height, original_width = (int(s) for s in original_size)
    height, width = features.shape[:2]
    if original_width / original_height > width / height:
        # Rounded to 7 digits as the reference does, so float noise cannot drop a row.
        kept = int(round(original_height * (width / original_width), 7))
        padding = (height - kept) // 2
        return features[padding : height - padding]
    kept = int(round(original_width * (height / original_height), 7))
    padding = (width - kept) // 2
    return features[:, padding : width - padding]


def _bilinear_matrix(size_in: int, size_out: int) -> np.ndarray:
    """(size_out, size_in) weights of PyTorch's bilinear resize along one axis
    (``align_corners=False``, no antialiasing)."""
    scale = size_in / size_out
    source = np.maximum((np.arange(size_out) + 0.5) * scale - 0.5, 0.0)
    low = np.floor(source).astype(np.int64)
    high = np.minimum(low + 1, size_in - 1)
    frac = source - low
    weights = np.zeros((size_out, size_in), dtype=np.float64)
    np.add.at(weights, (np.arange(size_out), low), 1.0 - frac)
    np.add.at(weights, (np.arange(size_out), high), frac)
    return weights


def resize_bilinear(features: mx.array, height: int, width: int) -> mx.array:
    """(H, W, dim) -> (height, width, dim), as ``F.interpolate(mode="bilinear")``."""
    rows = mx.array(_bilinear_matrix(features.shape[0], height), dtype=features.dtype)
    columns = mx.array(_bilinear_matrix(features.shape[1], width), dtype=features.dtype)
    resized = mx.einsum("hH,HWd->hWd", rows, features)
    return mx.einsum("wW,hWd->hwd", columns, resized)


def append_newlines(features: mx.array, newline: mx.array) -> mx.array:
    """(H, W, dim) map -> (H * (W + 1), dim) tokens, ``newline`` after every row."""
    height = features.shape[0]
    ends = mx.broadcast_to(newline.astype(features.dtype), (height, 1, newline.shape[-1]))
    return mx.concatenate([features, ends], axis=1).reshape(-1, newline.shape[-1])
