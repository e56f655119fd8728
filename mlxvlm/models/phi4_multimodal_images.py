"""Phi-4-multimodal's image preprocessing without torch: transformers'
``Phi4MultimodalImageProcessor`` (torchvision only) on its PIL/numpy backend, with the same
settings and outputs.

The HD transform: a picture is resized (aspect ratio kept) onto a grid of square crops
(``size``, 448 px) -- as many as it covers, or, past ``dynamic_hd`` crops, the grid whose
aspect ratio is closest -- and padded white to the grid; the crops follow a global view
(the padded picture resized to one crop). Each crop has a patch mask that marks the
padding patches, which the vision tower does not attend to and the model drops. The
first resize is torchvision's 8-bit antialiased bilinear (``resize_uint8``), the global
view torch's bicubic on floats without antialiasing (``bicubic_resize``), so the pixels
are transformers' own.
"""

from __future__ import annotations

import math

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import PILImageResampling
from transformers.processing_utils import ImagesKwargs

from mlxvlm.errors import MlxvlmError
from mlxvlm.models.resize_uint8 import resize_uint8


class Phi4MultimodalImagesKwargs(ImagesKwargs, total=False):
    patch_size: int
    dynamic_hd: int


def crop_layout(height: int, width: int, crop: int, max_crops: int):
    """``((columns, rows), (new_width, new_height), (pad_width, pad_height))``: the crop grid
    of a ``height`` x ``width`` picture, the size it is resized to and the padding that
    fills the grid (transformers' ``_get_crop_layout``)."""
    columns, rows = math.ceil(width / crop), math.ceil(height / crop)
    if columns * rows > max_crops:
        ratios = sorted({(i, j) for n in range(1, max_crops + 1) for i in range(1, n + 1)
                         for j in range(1, n + 1) if 1 <= i * j <= max_crops},
                        key=lambda r: r[0] * r[1])
        aspect, best, best_diff = width / height, (1, 1), float("inf")
        for ratio in ratios:
            diff = abs(aspect - ratio[0] / ratio[1])
            if diff < best_diff:
                best_diff, best = diff, ratio
            elif diff == best_diff and width * height > 0.5 * crop * crop * ratio[0] * ratio[1]:
                best = ratio
        columns, rows = best
    target_w, target_h = crop * columns, crop * rows
    if target_w / width < target_h / height:
        new = (target_w, int(height * (target_w / width)))
        pad = (0, target_h - new[1])
    else:
        new = (int(width * (target_h / height)), target_h)
        pad = (target_w - new[0], 0)
    if min(new[1], target_h) < 10 or min(new[0], target_w) < 10:
        # transformers' check ("the aspect ratio is very extreme"), as a user's error
        raise MlxvlmError(f"an image of {width} x {height} pixels is too narrow for "
                         f"Phi-4-multimodal's crops (one side would be {min(new)} pixels, "
                         "under 10); crop or pad it nearer to square")
    return (columns, rows), new, pad


def crop_mask(grid, pad, patch: int, mask_size: int) -> np.ndarray:
    """The patch mask of the whole grid: padding patches (a whole patch or more) are 0."""
    columns, rows = grid
    mask = np.ones((mask_size * rows, mask_size * columns), dtype=np.float32)
    if pad[0] >= patch:
        mask[:, -(pad[0] // patch):] = 0
    if pad[1] >= patch:
        mask[-(pad[1] // patch):, :] = 0
    return mask


def split_crops(array: np.ndarray, size: int) -> np.ndarray:
    """(..., rows*size, columns*size) -> (rows*columns, ..., size, size), row by row."""
    *lead, h, w = array.shape
    rows, columns = h // size, w // size
    tiles = array.reshape(*lead, rows, size, columns, size)
    order = (len(lead), len(lead) + 2, *range(len(lead)), len(lead) + 1, len(lead) + 3)
    return tiles.transpose(order).reshape(rows * columns, *lead, size, size)


def image_token_count(mask: np.ndarray, mask_size: int) -> int:
    """Placeholders of one picture: the global view's 16 x 16 tokens with a separator per
    row, one separator before them, and the crops' kept 2 x 2-pooled patches with one per
    row (transformers counts the global view for 448-px crops of 14-px patches)."""
    kept = split_crops(mask, mask_size)[:, 0::2, 0::2]
    rows, columns = mask.shape[0] // mask_size, mask.shape[1] // mask_size
    half = kept.shape[-1]
    grid = kept.reshape(rows, columns, half, half).transpose(0, 2, 1, 3).reshape(rows * half, columns * half)
    return 256 + 1 + int(grid.sum()) + int(grid[:, 0].sum()) + 16


def bicubic_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """torch's ``interpolate(mode="bicubic", align_corners=False)`` without antialiasing,
    of a float (C, H, W) image (Keys' kernel, a = -0.75, edges clamped)."""

    def taps(in_size: int, out_size: int):
        scale = in_size / out_size
        source = (np.arange(out_size) + 0.5) * scale - 0.5
        base = np.floor(source)
        t = source - base
        a = -0.75
        weights = np.stack([
            ((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
            ((a + 2) * t - (a + 3)) * t * t + 1,
            ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1,
            ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a,
        ], axis=1)
        index = np.clip(base[:, None].astype(np.int64) + np.arange(-1, 3)[None], 0, in_size - 1)
        return index, weights

    if image.shape[-2:] == (height, width):
        return image
    data = image.astype(np.float64)
    index, weights = taps(data.shape[-1], width)
    data = (data[..., index] * weights).sum(-1)
    index, weights = taps(data.shape[-2], height)
    data = (data[..., index, :] * weights[..., None]).sum(-2)
    return data.astype(np.float32)


class Phi4MultimodalImageProcessorPil(PilBackend):
    """transformers' ``Phi4MultimodalImageProcessor`` (defaults, keyword arguments and
    outputs) on PIL and numpy."""

    resample = PILImageResampling.BICUBIC
    size = {"height": 448, "width": 448}
    patch_size = 14
    dynamic_hd = 36
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    do_rescale = True
    rescale_factor = 1 / 255
    do_normalize = True
    do_convert_rgb = True
    valid_kwargs = Phi4MultimodalImagesKwargs
    model_input_names = ["image_pixel_values", "image_sizes", "image_attention_mask"]

    def _normalized(self, image: np.ndarray, o: dict) -> np.ndarray:
        # transformers fuses rescale and normalize: (x - 255 mean) / (255 std) in float32
        image = image.astype(np.float32)
        if o["do_rescale"] and o["do_normalize"]:
            scale = np.float32(1.0 / o["rescale_factor"])
            mean = (np.asarray(o["image_mean"], np.float32) * scale)[:, None, None]
            std = (np.asarray(o["image_std"], np.float32) * scale)[:, None, None]
            return (image - mean) / std
        if o["do_rescale"]:
            image = image * np.float32(o["rescale_factor"])
        if o["do_normalize"]:
            mean = np.asarray(o["image_mean"], np.float32)[:, None, None]
            std = np.asarray(o["image_std"], np.float32)[:, None, None]
            image = (image - mean) / std
        return image

    def _preprocess(self, images: list[np.ndarray], return_tensors=None, **o) -> BatchFeature:
        size = o["size"]
        if size.height != size.width:
            raise ValueError("Phi4MultimodalImageProcessor only supports square sizes.")
        crop, patch = size.height, o["patch_size"]
        mask_size = crop // patch
        pixels, masks, counts, sizes = [], [], [], []
        for image in images:
            if image.dtype != np.uint8:
                image = np.clip(np.round(image), 0, 255).astype(np.uint8)
            height, width = image.shape[-2:]
            grid, new, pad = crop_layout(height, width, crop, o["dynamic_hd"])
            mask = crop_mask(grid, pad, patch, mask_size)
            resized = resize_uint8(image, new[1], new[0])
            padded = np.pad(resized, ((0, 0), (0, pad[1]), (0, pad[0])), constant_values=255)
            processed = self._normalized(padded, o)
            global_view = bicubic_resize(processed, crop, crop)
            pixels.append(np.concatenate([global_view[None], split_crops(processed, crop)]))
            masks.append(np.concatenate([np.ones((1, mask_size, mask_size), np.float32),
                                         split_crops(mask, mask_size)]))
            counts.append(image_token_count(mask, mask_size))
            sizes.append(list(processed.shape[-2:]))
        most = max(len(p) for p in pixels)
        pixels = [np.concatenate([p, np.zeros((most - len(p), *p.shape[1:]), p.dtype)]) for p in pixels]
        masks = [np.concatenate([m, np.ones((most - len(m), *m.shape[1:]), m.dtype)]) for m in masks]
        data = {
            "image_pixel_values": np.stack(pixels),
            "image_sizes": np.array(sizes, dtype=np.int64),
            "image_attention_mask": np.stack(masks),
            "num_img_tokens": counts,
        }
        return BatchFeature(data=data, tensor_type=return_tensors)

    def get_number_of_image_tokens(self, height: int, width: int, images_kwargs=None) -> int:
        o = self._merge_and_standardize_kwargs(**(images_kwargs or {}))
        crop = o["size"]["height"]
        mask_size = crop // o["patch_size"]
        grid, _, pad = crop_layout(height, width, crop, o["dynamic_hd"])
        return image_token_count(crop_mask(grid, pad, o["patch_size"], mask_size), mask_size)
