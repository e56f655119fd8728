"""LLaVA-OneVision (Li et al., 2024): LLaVA (``llava.Model``) taking images by LLaVA-NeXT's
AnyRes (``llava_next.anyres_features``), with a SigLIP tower, a Qwen2 decoder
and one recipe per kind of input.

A single image is tiled with AnyRes as in LLaVA-NeXT, and an unpadded feature map larger
than ``anyres_max_N`` tiles (by more than 10% per side) is shrunk bilinearly to about N
tiles' worth before the row newlines. Several images in one prompt are each seen only
through their overview tile (plus one newline). A video's frames are each seen whole at
the tower's resolution, their feature maps halved bilinearly, all frames' tokens in time
order followed by one newline.

Checkpoint names: LLaVA-NeXT's.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import mlx.core as mx
import numpy as np

from mlxvlm.models import llava, llava_next, merge
from mlxvlm.models.layers import anyres
from mlxvlm.models.llava import ModelArgs
from mlxvlm.models.onevision_video import OnevisionVideoProcessor


def max_tiles(vision_aspect_ratio: str) -> int:
    """``"anyres_max_9"`` -> 9."""
    match = re.fullmatch(r"anyres_max_(\d+)", vision_aspect_ratio or "")
    if match is None:
        raise ValueError(f"unsupported vision_aspect_ratio {vision_aspect_ratio!r} (expected anyres_max_N)")
    return int(match.group(1))


class Model(llava.Model):
    feature_names = ("pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos")
    processor_class = "LlavaOnevisionProcessor"

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.image_newline = mx.zeros((args.text.hidden_size,))

    @classmethod
    def load_video_processor(cls, model_path):
        return OnevisionVideoProcessor.from_pretrained(model_path)

    def embed(self, input_ids: mx.array, pixel_values: Any = None,
              pixel_values_videos: Any = None, **features: Any):
        h, state = super().embed(input_ids, pixel_values, **features)
        if self.args.video_token_id is None:
            return h, state
        positions = merge.placeholder_positions(np.asarray(input_ids).reshape(-1),
                                                self.args.video_token_id)
        videos = None if pixel_values_videos is None else self.video_features(
            mx.array(pixel_values_videos) if not isinstance(pixel_values_videos, mx.array)
            else pixel_values_videos)
        return merge.merge_features(h, positions, videos, "video placeholder tokens"), state

    def image_features(self, pixel_values: mx.array, image_sizes: Any = None,
                       batch_num_images: Any = None, **features: Any) -> mx.array:
        """LLaVA-NeXT's AnyRes images (``llava_next.anyres_features``), tiled only where
        an image is alone in its prompt and shrunk to ``anyres_max_N`` tiles."""
        def num_tiles(index: int, image_size: np.ndarray) -> int:
            return self.num_tiles(index, image_size, batch_num_images)

        return llava_next.anyres_features(self, pixel_values, image_sizes, num_tiles, self.shrink)

    def video_features(self, pixel_values_videos: mx.array) -> mx.array:
        """(videos, frames, C, H, W) -> each video's tokens (its frames' pooled feature
        maps in time order, then a newline), the videos one after another."""
        videos, frames = pixel_values_videos.shape[:2]
        tiles = pixel_values_videos.reshape(videos * frames, *pixel_values_videos.shape[2:])
        projected = self.tile_features(tiles)
        side = self.args.vision.patches_per_side
        if projected.shape[1] != side * side:
            raise ValueError(f"a frame gives {projected.shape[1]} tokens, not the {side}x{side} "
                             "grid video pooling needs")
        pooled_side = math.ceil(side / 2)
        maps = projected.reshape(videos * frames, side, side, -1)
        pooled = mx.stack([anyres.resize_bilinear(m, pooled_side, pooled_side) for m in maps])
        pooled = pooled.reshape(videos, frames * pooled_side * pooled_side, -1)
        newline = mx.broadcast_to(self.image_newline.astype(pooled.dtype)[None, None],
                                  (videos, 1, pooled.shape[-1]))
        return mx.concatenate([pooled, newline], axis=1).reshape(-1, pooled.shape[-1])

    @classmethod
    def processor_type(cls) -> type:
        return prompt_images_as_one_sample(super().processor_type())

    @classmethod
    def default_processor_options(cls, config: dict) -> dict:
        """What LlavaOnevisionProcessor needs to count an image's placeholders."""
        if not config:
            return {}
        args = ModelArgs.from_hf(config)
        tokens = args.vision.patches_per_side**2
        if llava.vision_tower_class(args.vision).has_class_token:
            tokens += 1
        return {
            "num_image_tokens": tokens,
            "vision_feature_select_strategy": args.vision_feature_select_strategy,
            "vision_aspect_ratio": args.vision_aspect_ratio,
        }

    def num_tiles(self, index: int, image_size: np.ndarray, batch_num_images: Any = None) -> int:
        """AnyRes tiles for an image alone in its prompt, the overview only for an image
        among several (the processor's ``batch_num_images`` counts images per prompt)."""
        if batch_num_images is not None:
            alone = [n == 1 for n in np.asarray(batch_num_images).reshape(-1).tolist() for _ in range(n)]
            if not alone[index]:
                return 1
        return anyres.num_tiles(image_size, llava_next.pinpoints(self.args),
                                self.args.vision.image_size)

    def shrink(self, grid: mx.array) -> mx.array:
        side = self.args.vision.patches_per_side
        height, width = grid.shape[:2]
        ratio = math.sqrt(height * width / (max_tiles(self.args.vision_aspect_ratio) * side**2))
        if ratio <= 1.1:
            return grid
        return anyres.resize_bilinear(grid, int(height // ratio), int(width // ratio))


@functools.cache
def prompt_images_as_one_sample(processor_class: type) -> type:
    """``processor_class`` taking a flat image list for one prompt as that prompt's images.

    transformers' chat-template path passes images nested per conversation, which is what
    tells OneVision's image processor that several images share a prompt (and so are not
    tiled); mlxvlm passes one prompt's images as a flat list."""

    def __call__(self, images=None, text=None, *args, **kwargs):
        single_prompt = isinstance(text, str) or (isinstance(text, (list, tuple)) and len(text) == 1)
        if single_prompt and isinstance(images, (list, tuple)) and images and not isinstance(images[0], (list, tuple)):
            images = [list(images)]
        return processor_class.__call__(self, images, text, *args, **kwargs)

    return type(processor_class.__name__, (processor_class,), {"__call__": __call__})


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
