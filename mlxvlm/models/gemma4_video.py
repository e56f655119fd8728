"""Gemma 4's video preprocessing in numpy, standing in for transformers'
``Gemma4VideoProcessor`` (which needs torchvision) inside transformers' Gemma 4
processor. Frames are sampled by count, ``num_frames`` one even step apart
(``frame_sampling = "step"``, as transformers' ``BaseVideoProcessor.sample_frames``);
each video is resized as a whole, its aspect ratio kept, to the largest size within the
per-frame patch budget whose sides are multiples of ``pooling_kernel_size * patch_size``
(torchvision's antialiased bicubic on uint8), rescaled, cut into patches and padded to the
budget with positions -1, as Gemma 4's image processor does to an image."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mlxvlm.models.processor_utils import NumpyVideoProcessor
from mlxvlm.models.video_resize import resize_uint8


def aspect_ratio_preserving_size(height: int, width: int, patch_size: int, max_patches: int,
                                 pooling_kernel_size: int) -> tuple[int, int]:
    """transformers' ``get_aspect_ratio_preserving_size`` (shared by Gemma 4's image and
    video processors), read from transformers' module so that the two cannot drift."""
    from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

    return get_aspect_ratio_preserving_size(height=height, width=width, patch_size=patch_size,
                                            max_patches=max_patches,
                                            pooling_kernel_size=pooling_kernel_size)


class Gemma4VideoProcessor(NumpyVideoProcessor):
    """Numpy twin of transformers' ``Gemma4VideoProcessor``."""

    model_input_names = ["pixel_values_videos", "video_position_ids", "num_frames_per_video"]
    frame_sampling = "step"

    def __init__(self, num_frames: int = 32, patch_size: int = 16, max_soft_tokens: int = 70,
                 pooling_kernel_size: int = 3, resample: int = 3, do_resize: bool = True,
                 do_rescale: bool = True, rescale_factor: float = 1 / 255,
                 do_normalize: bool = True, image_mean: Sequence[float] = (0.0,) * 3,
                 image_std: Sequence[float] = (1.0,) * 3, **_: Any):
        if int(resample) != 3:
            raise NotImplementedError(f"Gemma 4 video resampling filter {resample} (only bicubic)")
        self.num_frames = num_frames
        self.patch_size, self.max_soft_tokens = patch_size, max_soft_tokens
        self.pooling_kernel_size = pooling_kernel_size
        self.do_resize, self.do_rescale, self.do_normalize = do_resize, do_rescale, do_normalize
        self.rescale_factor = rescale_factor
        self.image_mean, self.image_std = list(image_mean), list(image_std)

    def __call__(self, videos: Any, video_metadata: Any = None, return_metadata: bool = False,
                 return_tensors: Any = None, **_: Any):
        """Frames arrive sampled already: options for sampling do not apply."""
        from transformers.video_utils import make_batched_videos

        max_patches = self.max_soft_tokens * self.pooling_kernel_size**2
        pixels, positions, frames_per_video, tokens_per_video = [], [], [], []
        for video in make_batched_videos(videos):
            patches, grid = self.patches(np.asarray(video), max_patches)
            pixels.append(patches)
            positions.append(grid)
            frames_per_video.append(len(patches))
            tokens_per_video.append(int((grid[0, :, 0] >= 0).sum()) // self.pooling_kernel_size**2)
        data = {
            "pixel_values_videos": np.concatenate(pixels),
            "video_position_ids": np.concatenate(positions),
            "num_frames_per_video": frames_per_video,
            "num_soft_tokens_per_video": tokens_per_video,
        }
        return self.batch_feature(data, list(videos), video_metadata, return_metadata,
                                  return_tensors)

    def patches(self, frames: np.ndarray, max_patches: int) -> tuple[np.ndarray, np.ndarray]:
        """(T, H, W, 3) uint8 -> patches (T, max_patches, patch**2 * 3) float32 and their
        (x, y) positions (T, max_patches, 2), -1 where padded."""
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"expected RGB frames of shape (T, H, W, 3), got {frames.shape}")
        p = self.patch_size
        if self.do_resize:
            height, width = aspect_ratio_preserving_size(
                frames.shape[1], frames.shape[2], p, max_patches, self.pooling_kernel_size)
            if (height, width) != frames.shape[1:3]:
                frames = resize_uint8(frames, height, width, "bicubic")
        values = frames.astype(np.float32)
        if self.do_normalize:  # as transformers fuses them: one division by std / factor
            scale = np.float32(1.0 / self.rescale_factor) if self.do_rescale else np.float32(1)
            values = (values - np.asarray(self.image_mean, np.float32) * scale) / (
                np.asarray(self.image_std, np.float32) * scale)
        elif self.do_rescale:
            values = values * np.float32(self.rescale_factor)
        T, H, W, C = values.shape
        rows, cols = H // p, W // p
        patches = values.reshape(T, rows, p, cols, p, C).transpose(0, 1, 3, 2, 4, 5)
        patches = patches.reshape(T, rows * cols, p * p * C)
        grid_x, grid_y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
        grid = np.stack([grid_x, grid_y], axis=-1).reshape(rows * cols, 2)
        padded = np.zeros((T, max_patches, p * p * C), np.float32)
        padded[:, : rows * cols] = patches
        positions = np.full((T, max_patches, 2), -1, np.int64)
        positions[:, : rows * cols] = grid
        return padded, positions
