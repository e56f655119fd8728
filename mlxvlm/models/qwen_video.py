"""Qwen2-VL's video preprocessing in numpy, for the processors of the Qwen-VL and
Qwen-Omni families.

transformers' ``Qwen2VLVideoProcessor`` needs torchvision, which mlxvlm never imports. This
processor stands in for it inside the transformers processor (``video_processor``) and
does the same maths on the frames ``mlxvlm.media.load_video`` sampled:

1. resize every frame to ``smart_resize(h, w)`` (sides multiples of ``patch_size *
   merge_size``, pixels within ``size``) with the antialiased bicubic filter torchvision
   applies to uint8 frames on the CPU (``video_resize.resize_bicubic_uint8``);
2. rescale and normalize in float32: ``(x - 255 * mean) / (255 * std)``;
3. repeat the last frame up to a multiple of ``temporal_patch_size``;
4. cut ``temporal_patch_size x patch x patch`` patches, each merge block's patches
   contiguous, flattened channels first — the layout the Qwen vision tower reads.

Frames are not sampled again here: ``load_video`` already sampled them as the family's
transformers processor does (``frame_sampling`` names the way, see
``mlxvlm.media.frame_sampling``), and ``video_metadata`` (transformers'
``VideoMetadata``) says how.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from mlxvlm.models.processor_utils import NumpyVideoProcessor
from mlxvlm.models.video_resize import BICUBIC, resize_bicubic_uint8

# transformers' Qwen2VLVideoProcessor defaults (OPENAI_CLIP_MEAN / _STD).
DEFAULT_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# transformers' Qwen3VLVideoProcessor defaults (IMAGENET_STANDARD_MEAN / _STD are 0.5).
QWEN3_DEFAULT_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}
IMAGENET_HALF = (0.5, 0.5, 0.5)


# ---------------------------------------------------------------------- the processor


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """transformers' own ``smart_resize`` (the PIL image processor's module imports
    without torch): sides multiples of ``factor``, pixels within the limits."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


class QwenVideoProcessor(NumpyVideoProcessor):
    """Numpy twin of transformers' ``Qwen2VLVideoProcessor`` (see the module docstring)."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    # How load_video picks the frames (mlxvlm.media.frame_sampling), and the settings it
    # reads: Qwen2VLVideoProcessor.sample_frames'.
    frame_sampling = "qwen2_vl"

    def __init__(
        self,
        size: dict | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        patch_size: int = 14,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        image_mean: Sequence[float] = CLIP_MEAN,
        image_std: Sequence[float] = CLIP_STD,
        rescale_factor: float = 1 / 255,
        do_resize: bool = True,
        do_rescale: bool = True,
        do_normalize: bool = True,
        resample: int = BICUBIC,
        cap_pixels_per_frame: bool | None = None,
        max_video_tokens: int = 128_000,
        min_frames: int = 4,
        max_frames: int = 768,
        fps: float | None = None,
        num_frames: int | None = None,
        **_: Any,
    ):
        size = dict(size or DEFAULT_SIZE)
        # As transformers: min_pixels / max_pixels (older configs) override size.
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        self.size = size
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.image_mean = list(image_mean)
        self.image_std = list(image_std)
        self.rescale_factor = rescale_factor
        self.do_resize, self.do_rescale, self.do_normalize = do_resize, do_rescale, do_normalize
        self.resample = resample
        self.cap_pixels_per_frame = cap_pixels_per_frame
        self.max_video_tokens = max_video_tokens
        self.min_frames, self.max_frames = min_frames, max_frames
        self.fps, self.num_frames = fps, num_frames

    # -- transformers' video processor interface ---------------------------------------

    def __call__(self, videos: Any, video_metadata: Any = None, return_metadata: bool = False,
                 return_tensors: Any = None, **kwargs: Any):
        from transformers.video_utils import make_batched_videos

        videos = [np.asarray(v) for v in make_batched_videos(videos)]
        options = self._options(**kwargs)
        patches, grids = [], []
        for video in videos:
            video_patches, grid = self.preprocess_video(video, **options)
            patches.append(video_patches)
            grids.append(grid)
        data = {
            "pixel_values_videos": np.concatenate(patches, axis=0),
            "video_grid_thw": np.array(grids, dtype=np.int64),
        }
        return self.batch_feature(data, videos, video_metadata, return_metadata, return_tensors)

    def _options(self, size=None, min_pixels=None, max_pixels=None, patch_size=None,
                 temporal_patch_size=None, merge_size=None, image_mean=None, image_std=None,
                 rescale_factor=None, do_resize=None, do_rescale=None, do_normalize=None,
                 resample=None, cap_pixels_per_frame=None, max_video_tokens=None,
                 **_: Any) -> dict:
        """Call options over the instance's settings (transformers' precedence). Options
        transformers' processor passes that do not apply to frames sampled already
        (``fps``, ``do_sample_frames``, ``device`` ...) are ignored."""
        size = dict(size or self.size)
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        resample = self.resample if resample is None else resample
        if int(resample) != BICUBIC:
            raise NotImplementedError(
                f"video resampling filter {resample} is not supported (only bicubic, which "
                "every Qwen-VL checkpoint uses)"
            )
        pick = lambda value, default: default if value is None else value  # noqa: E731
        return dict(
            size=size,
            patch_size=pick(patch_size, self.patch_size),
            temporal_patch_size=pick(temporal_patch_size, self.temporal_patch_size),
            merge_size=pick(merge_size, self.merge_size),
            image_mean=pick(image_mean, self.image_mean),
            image_std=pick(image_std, self.image_std),
            rescale_factor=pick(rescale_factor, self.rescale_factor),
            do_resize=pick(do_resize, self.do_resize),
            do_rescale=pick(do_rescale, self.do_rescale),
            do_normalize=pick(do_normalize, self.do_normalize),
            cap_pixels_per_frame=pick(cap_pixels_per_frame, self.cap_pixels_per_frame),
            max_video_tokens=pick(max_video_tokens, self.max_video_tokens),
        )

    def frame_size(self, num_frames: int, height: int, width: int, *, size: dict,
                   patch_size: int, merge_size: int, temporal_patch_size: int,
                   cap_pixels_per_frame: bool | None, max_video_tokens: int) -> tuple[int, int]:
        """The resized frame (height, width). With ``cap_pixels_per_frame`` each frame also
        gets at most an even share of ``max_video_tokens`` tokens' pixels (qwen-vl-utils)."""
        factor = patch_size * merge_size
        max_pixels = size["longest_edge"]
        if cap_pixels_per_frame:
            total = int(max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * temporal_patch_size // num_frames),
                             int(size["shortest_edge"] * 1.05))
        return smart_resize(height, width, factor, size["shortest_edge"], max_pixels)

    def preprocess_video(self, frames: np.ndarray, *, size: dict, patch_size: int,
                         temporal_patch_size: int, merge_size: int, image_mean, image_std,
                         rescale_factor: float, do_resize: bool, do_rescale: bool,
                         do_normalize: bool, cap_pixels_per_frame: bool | None,
                         max_video_tokens: int) -> tuple[np.ndarray, list[int]]:
        """(T, H, W, 3) uint8 frames -> flattened patches (t*h*w, 3*tps*p*p) and [t, h, w]."""
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"expected RGB frames of shape (T, H, W, 3), got {frames.shape}")
        count, height, width, _ = frames.shape
        if do_resize:
            height, width = self.frame_size(
                count, height, width, size=size, patch_size=patch_size, merge_size=merge_size,
                temporal_patch_size=temporal_patch_size,
                cap_pixels_per_frame=cap_pixels_per_frame, max_video_tokens=max_video_tokens,
            )
            frames = resize_bicubic_uint8(frames, height, width)
        pixels = frames.astype(np.float32)
        if do_normalize:
            scale = np.float32(1.0 / rescale_factor) if do_rescale else np.float32(1.0)
            mean = np.asarray(image_mean, np.float32) * scale
            std = np.asarray(image_std, np.float32) * scale
            pixels = (pixels - mean) / std
        elif do_rescale:
            pixels = pixels * np.float32(rescale_factor)
        pad = -count % temporal_patch_size
        if pad:
            pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
        grid_t = pixels.shape[0] // temporal_patch_size
        grid_h, grid_w = height // patch_size, width // patch_size
        m, p = merge_size, patch_size
        patches = pixels.reshape(grid_t, temporal_patch_size, grid_h // m, m, p, grid_w // m, m, p, 3)
        # -> (t, h-blocks, w-blocks, m, m, channels, temporal, p, p)
        patches = patches.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
        flat = patches.reshape(grid_t * grid_h * grid_w, 3 * temporal_patch_size * p * p)
        return np.ascontiguousarray(flat), [grid_t, grid_h, grid_w]


# ------------------------------------------------------------------------- Qwen3-VL


def qwen3_frame_size(num_frames: int, height: int, width: int, *, factor: int,
                     temporal_factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's resize rule: sides multiples of ``factor``, and the pixels of the whole
    video -- its frames rounded to a multiple of ``temporal_factor`` -- within the limits
    (transformers' ``video_processing_qwen3_vl.smart_resize``)."""
    if num_frames < temporal_factor:
        raise ValueError(f"Qwen3-VL needs at least {temporal_factor} frames, got {num_frames}")
    if height < factor or width < factor:  # too small a side: scale up first
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the frames' aspect ratio {width}:{height} is beyond 200")
    frames = round(num_frames / temporal_factor) * temporal_factor
    new_h, new_w = round(height / factor) * factor, round(width / factor) * factor
    if frames * new_h * new_w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        new_h = max(factor, math.floor(height / beta / factor) * factor)
        new_w = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * new_h * new_w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        new_h = math.ceil(height * beta / factor) * factor
        new_w = math.ceil(width * beta / factor) * factor
    return new_h, new_w


class Qwen3VideoProcessor(QwenVideoProcessor):
    """Numpy twin of transformers' ``Qwen3VLVideoProcessor``: Qwen2-VL's steps with
    16-pixel patches, a pixel budget for the whole video (``size["longest_edge"]``), and
    frames spread from the first to the last at 2 fps by default."""

    frame_sampling = "qwen3_vl"

    def __init__(self, size: dict | None = None, patch_size: int = 16,
                 image_mean: Sequence[float] = IMAGENET_HALF, image_std: Sequence[float] = IMAGENET_HALF,
                 max_video_tokens: int = 768, fps: float | None = 2, **settings: Any):
        super().__init__(size=dict(size or QWEN3_DEFAULT_SIZE), patch_size=patch_size,
                         image_mean=image_mean, image_std=image_std,
                         max_video_tokens=max_video_tokens, fps=fps, **settings)

    def frame_size(self, num_frames, height, width, *, size, patch_size, merge_size,
                   temporal_patch_size, cap_pixels_per_frame, max_video_tokens):
        """With ``cap_pixels_per_frame`` each frame gets at most ``max_video_tokens``
        tokens' pixels or an even share of the budget (at least 1.05 x the minimum)."""
        factor = patch_size * merge_size
        max_pixels = size["longest_edge"]
        if cap_pixels_per_frame:
            per_frame = max(min(max_video_tokens * factor * factor, max_pixels // num_frames),
                            int(size["shortest_edge"] * 1.05))
            max_pixels = per_frame * num_frames
        return qwen3_frame_size(num_frames, height, width, factor=factor,
                                temporal_factor=temporal_patch_size,
                                min_pixels=size["shortest_edge"], max_pixels=max_pixels)
