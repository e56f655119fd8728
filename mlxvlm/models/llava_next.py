"""LLaVA-NeXT (LLaVA 1.6, Liu et al., 2024): LLaVA with AnyRes high-resolution input.

The processor cuts each image into a grid of tower-sized tiles (the grid that best fits
the image among ``image_grid_pinpoints``) after a downscaled overview tile. The tower and
projector run on every tile as in LLaVA; then the grid tiles are stitched into one
feature map, its padding is cut off, and ``image_newline`` ends every row (see
``layers/anyres.py``). An image's tokens are the overview's, then the map's.

Checkpoint names: LLaVA's plus the top-level ``image_newline``.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxvlm.models import llava
from mlxvlm.models.layers import anyres
from mlxvlm.models.llava import ModelArgs


class Model(llava.Model):
    feature_names = ("pixel_values", "image_sizes")
    processor_class = "LlavaNextProcessor"

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.image_newline = mx.zeros((args.text.hidden_size,))

    def image_features(self, pixel_values: mx.array, image_sizes: Any = None, **features: Any):
        return anyres_features(self, pixel_values, image_sizes, self.num_tiles, self.shrink)

    def num_tiles(self, index: int, image_size: np.ndarray) -> int:
        """How many tiles the processor made of image ``index``."""
        return anyres.num_tiles(image_size, pinpoints(self.args), self.args.vision.image_size)

    def shrink(self, grid: mx.array) -> mx.array:
        """LLaVA-NeXT keeps the unpadded map whole (OneVision downsamples large ones)."""
        return grid


# -- AnyRes images, which LLaVA-OneVision takes the same way ------------------------------


def pinpoints(args: ModelArgs) -> list[list[int]]:
    return [list(p) for p in args.image_grid_pinpoints]


def anyres_features(model: llava.Model, pixel_values: mx.array, image_sizes: Any,
                    num_tiles: Callable[[int, np.ndarray], int],
                    shrink: Callable[[mx.array], mx.array]) -> mx.array:
    """All images' feature tokens, in prompt order: each image's tiles (``num_tiles(index,
    size)`` of them) through ``model``'s tower and projector, then packed by
    ``pack_image`` (its map downsampled by ``shrink``)."""
    if image_sizes is None:
        raise ValueError(f"{type(model).__module__} needs image_sizes to place AnyRes tiles")
    sizes = np.asarray(image_sizes, dtype=np.int64).reshape(-1, 2)
    counts = [num_tiles(i, size) for i, size in enumerate(sizes)]
    if pixel_values.ndim == 5:  # (images, tiles padded to the most, C, H, W)
        tiles = mx.concatenate([pixel_values[i, :n] for i, n in enumerate(counts)])
    else:  # (all tiles, C, H, W)
        tiles = pixel_values
    if tiles.shape[0] != sum(counts):
        raise ValueError(
            f"got {tiles.shape[0]} image tiles but the image sizes call for {sum(counts)}"
        )
    projected = model.tile_features(tiles)
    packed, start = [], 0
    for size, count in zip(sizes, counts):
        packed.append(pack_image(model, projected[start : start + count], size, shrink))
        start += count
    return mx.concatenate(packed)


def pack_image(model: llava.Model, tiles: mx.array, image_size: np.ndarray,
               shrink: Callable[[mx.array], mx.array]) -> mx.array:
    """One image's projected tiles (overview first) -> its feature tokens."""
    args, newline = model.args, model.image_newline
    overview = tiles[0]
    if tiles.shape[0] == 1:
        return mx.concatenate([overview, newline[None].astype(overview.dtype)])
    side = args.vision.patches_per_side
    if tiles.shape[1] != side * side:
        raise ValueError(
            f"a tile gives {tiles.shape[1]} tokens, not the {side}x{side} grid AnyRes needs "
            "(a tower with a class token must use vision_feature_select_strategy='default')"
        )
    rows, columns = anyres.tile_grid(image_size, pinpoints(args), args.vision.image_size)
    grid = anyres.unpad(anyres.stitch_tiles(tiles[1:], rows, columns, side), image_size)
    return mx.concatenate([overview, anyres.append_newlines(shrink(grid), newline)])


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
