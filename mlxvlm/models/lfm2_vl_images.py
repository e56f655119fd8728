"""LFM2-VL's image preprocessing without torch: transformers' ``Lfm2VlImageProcessor``
(torchvision only) on its PIL/numpy backend, with the same settings and outputs.

An image whose patch grid, rounded, is at most ``max_pixels_tolerance`` times the
token budget is resized as one (``smart_resize``: sides a multiple of
``encoder_patch_size * downsample_factor``, between ``min_image_tokens`` and
``max_image_tokens`` tokens, aspect ratio kept). A larger one is resized onto the grid of
``tile_size`` tiles (between ``min_tiles`` and ``max_tiles``) whose aspect ratio is
closest to its own, cut into those tiles, row by row, and followed by a thumbnail at the
single-image size (``use_thumbnail``). Every tile and image is then flattened into
``encoder_patch_size`` patches, padded to one patch count, with its patch mask and its
``(rows, columns)`` patch grid (``spatial_shapes``). Bilinear resizing of 8-bit images is
torchvision's (``resize_uint8``), so the pixels are transformers' own.
"""

from __future__ import annotations

import math

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import PILImageResampling, SizeDict
from transformers.processing_utils import ImagesKwargs

from mlxvlm.models.resize_uint8 import resize_uint8


class Lfm2VlImagesKwargs(ImagesKwargs, total=False):
    """The settings beyond every image processor's (transformers' own class of them
    imports torchvision)."""

    downsample_factor: int
    do_image_splitting: bool
    min_tiles: int
    max_tiles: int
    use_thumbnail: bool
    min_image_tokens: int
    max_image_tokens: int
    encoder_patch_size: int
    tile_size: int
    max_pixels_tolerance: float
    do_pad: bool
    return_row_col_info: bool


def _round_to(value: float, factor: int) -> int:
    return round(value / factor) * factor


def tile_grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """(columns, rows) grids with ``min_tiles`` to ``max_tiles`` tiles, fewest tiles first.
    Grids of one tile count keep the order of a set built as transformers builds it: that
    order decides between two grids equally near an image's aspect ratio."""
    grids = [(w, h) for n in range(min_tiles, max_tiles + 1) for w in range(1, n + 1)
             for h in range(1, n + 1) if min_tiles <= w * h <= max_tiles]
    return sorted(set(grids), key=lambda g: g[0] * g[1])


def closest_grid(width: int, height: int, grids, tile_size: int) -> tuple[int, int]:
    """The grid whose aspect ratio is nearest the image's; among equally near ones the
    later, once the image covers more than half of its area."""
    aspect = width / height
    best, best_difference = (1, 1), float("inf")
    for grid in grids:
        difference = abs(aspect - grid[0] / grid[1])
        if difference < best_difference:
            best, best_difference = grid, difference
        elif difference == best_difference and width * height > 0.5 * tile_size**2 * grid[0] * grid[1]:
            best = grid
    return best


class Lfm2VlImageProcessorPil(PilBackend):
    """transformers' ``Lfm2VlImageProcessor`` (defaults, keyword arguments and outputs) on
    PIL and numpy."""

    downsample_factor = 2
    do_image_splitting = True
    min_tiles = 2
    max_tiles = 10
    use_thumbnail = True
    min_image_tokens = 64
    max_image_tokens = 256
    encoder_patch_size = 16
    tile_size = 512
    max_pixels_tolerance = 2.0
    do_resize = True
    size = {"height": 512, "width": 512}
    resample = PILImageResampling.BILINEAR
    do_rescale = True
    rescale_factor = 1 / 255
    do_normalize = True
    do_pad = True
    return_row_col_info = False
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    model_input_names = ["pixel_values", "pixel_attention_mask", "spatial_shapes"]
    valid_kwargs = Lfm2VlImagesKwargs

    # -- sizes ------------------------------------------------------------------------

    def single_size(self, height: int, width: int, o: dict) -> tuple[int, int]:
        """(height, width) of the image resized as one (``smart_resize``)."""
        factor = o["encoder_patch_size"] * o["downsample_factor"]
        token_pixels = o["encoder_patch_size"] ** 2 * o["downsample_factor"] ** 2
        low, high = o["min_image_tokens"] * token_pixels, o["max_image_tokens"] * token_pixels
        h = max(factor, _round_to(height, factor))
        w = max(factor, _round_to(width, factor))
        if h * w > high:
            beta = math.sqrt(height * width / high)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < low:
            beta = math.sqrt(low / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def is_too_large(self, height: int, width: int, o: dict) -> bool:
        factor = o["encoder_patch_size"] * o["downsample_factor"]
        h = max(o["encoder_patch_size"], _round_to(height, factor))
        w = max(o["encoder_patch_size"], _round_to(width, factor))
        budget = o["max_image_tokens"] * o["encoder_patch_size"] ** 2 * o["downsample_factor"] ** 2
        return h * w > budget * o["max_pixels_tolerance"]

    # -- preprocessing ----------------------------------------------------------------

    def _resized(self, image: np.ndarray, height: int, width: int, resample) -> np.ndarray:
        # torchvision's bilinear pixels, as transformers' processor gives them
        if image.dtype == np.uint8 and resample in (PILImageResampling.BILINEAR, None):
            return resize_uint8(image, height, width)
        return self.resize(image, SizeDict(height=height, width=width), resample=resample)

    def views(self, image: np.ndarray, o: dict) -> tuple[list[np.ndarray], int, int, list[int]]:
        """The tiles (and thumbnail) or the single view of one (C, H, W) image, its tile
        rows and columns, and the single-image size."""
        height, width = image.shape[-2:]
        min_tiles, max_tiles = (o["min_tiles"], o["max_tiles"]) if o["do_image_splitting"] else (1, 1)
        if o["do_image_splitting"] and min_tiles > max_tiles:
            raise ValueError("min_tiles must be less than or equal to max_tiles")
        size = self.single_size(height, width, o)
        splits = not min_tiles == max_tiles == 1
        if not (splits and self.is_too_large(height, width, o)):
            return [self._resized(image, *size, o["resample"])], 1, 1, list(size)
        tile = o["tile_size"]
        columns, rows = closest_grid(width, height, tile_grids(min_tiles, max_tiles), tile)
        grid_image = self._resized(image, rows * tile, columns * tile, o["resample"])
        views = [grid_image[:, r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
                 for r in range(rows) for c in range(columns)]
        if o["use_thumbnail"] and rows * columns != 1:
            views.append(self._resized(image, *size, o["resample"]))
        return views, rows, columns, list(size)

    def _preprocess(self, images: list[np.ndarray], return_tensors=None, **o) -> BatchFeature:
        p = o["encoder_patch_size"]
        splitting_patches = (o["tile_size"] // p) ** 2 if o["do_image_splitting"] else 0
        max_patches = max(o["max_image_tokens"] * o["downsample_factor"] ** 2, splitting_patches)
        pixel_values, masks, shapes, rows, columns, sizes = [], [], [], [], [], []
        for image in images:
            views, r, c, size = self.views(image, o)
            rows.append(r)
            columns.append(c)
            sizes.append(size)
            for view in views:
                if o["do_rescale"]:
                    view = self.rescale(view, o["rescale_factor"])
                if o["do_normalize"]:
                    view = self.normalize(view, o["image_mean"], o["image_std"])
                channels, h, w = view.shape
                patches = view.reshape(channels, h // p, p, w // p, p).transpose(1, 3, 2, 4, 0)
                patches = patches.reshape((h // p) * (w // p), p * p * channels)
                shapes.append([h // p, w // p])
                if o["do_pad"]:
                    mask = np.zeros(max_patches, dtype=np.int32)
                    mask[: len(patches)] = 1
                    masks.append(mask)
                    patches = np.pad(patches, ((0, max_patches - len(patches)), (0, 0)))
                pixel_values.append(patches)
        data = {"pixel_values": np.stack(pixel_values)}
        if o["do_pad"]:
            data["pixel_attention_mask"] = np.stack(masks)
            data["spatial_shapes"] = np.array(shapes, dtype=np.int64)
        if o["return_row_col_info"]:
            data.update(image_rows=rows, image_cols=columns, image_sizes=sizes)
        return BatchFeature(data=data, tensor_type=return_tensors)
