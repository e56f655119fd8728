"""Qwen2-VL's video preprocessing in numpy, for the processors of the Qwen-VL and
Qwen-Omni families.

transformers' ``Qwen2VLVideoProcessor`` needs torchvision, which mlxvlm never imports. This
processor stands in for it inside the transformers processor (``video_processor``) and
does the same maths on the frames ``mlxvlm.media.load_video`` sampled:

1. resize every frame to ``smart_resize(h, w)`` (sides multiples of ``patch_size *
   merge_size``, pixels within ``size``) with the antialiased bicubic filter torchvision
   applies to uint8 frames on the CPU (:func:`resize_bicubic_uint8`);
2. rescale and normalize in float32: ``(x - 255 * mean) / (255 * std)``;
3. repeat the last frame up to a multiple of ``temporal_patch_size``;
4. cut ``temporal_patch_size x patch x patch`` patches, each merge block's patches
   contiguous, flattened channels first — the layout the Qwen vision tower reads.

Frames are not sampled again here: ``load_video`` already sampled them at the requested
fps, and ``video_metadata`` (transformers' ``VideoMetadata``) says how.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mlxvlm.models.processor_utils import NumpyVideoProcessor

# transformers' Qwen2VLVideoProcessor defaults (OPENAI_CLIP_MEAN / _STD).
DEFAULT_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL's (and transformers' PILImageResampling) number for bicubic


# ------------------------------------------------------------------ antialiased bicubic


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    """Keys' cubic convolution kernel with a = -0.5 (PIL's and torch's antialiased one)."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _int16_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """For each output pixel: the first input pixel, the integer weights of its taps, and
    the weights' fixed-point precision — torch's uint8 antialiased resampling, which
    widens the filter by the scale when downscaling and keeps weights in int16."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = int(np.ceil(support)) * 2 + 1
    inv_scale = 1.0 / scale if scale >= 1.0 else 1.0
    centers = scale * (np.arange(out_size) + 0.5)
    first = np.maximum((centers - support + 0.5).astype(np.int64), 0)
    last = np.minimum((centers + support + 0.5).astype(np.int64), in_size)
    count = np.clip(last - first, 0, taps)
    offsets = np.arange(taps)
    weights = _cubic((offsets[None, :] + first[:, None] - centers[:, None] + 0.5) * inv_scale)
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


def _resample_axis(pixels: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One separable pass along ``axis`` of uint8 ``pixels``, rounded back to uint8."""
    in_size = pixels.shape[axis]
    first, weights, precision = _int16_taps(in_size, out_size)
    source = np.moveaxis(pixels, axis, -1).astype(np.int32)
    padded = np.concatenate(
        [source, np.zeros(source.shape[:-1] + (weights.shape[1],), np.int32)], axis=-1
    )
    total = np.full(source.shape[:-1] + (out_size,), 1 << (precision - 1), np.int64)
    for tap in range(weights.shape[1]):
        total += padded[..., first + tap] * weights[:, tap]
    result = np.clip(total >> precision, 0, 255).astype(np.uint8)
    return np.moveaxis(result, -1, axis)


def resize_bicubic_uint8(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize uint8 frames (..., H, W, C) as torchvision resizes uint8 tensors on the CPU
    (``antialias=True``, bicubic): the width first, then the height, each pass in integer
    arithmetic with int16 weights and rounded to uint8 — bit for bit the same pixels."""
    if frames.shape[-3:-1] == (height, width):
        return frames
    if frames.shape[-2] != width:
        frames = _resample_axis(frames, width, axis=frames.ndim - 2)
    if frames.shape[-3] != height:
        frames = _resample_axis(frames, height, axis=frames.ndim - 3)
    return frames


# ---------------------------------------------------------------------- the processor


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """transformers' own ``smart_resize`` (the PIL image processor's module imports
    without torch): sides multiples of ``factor``, pixels within the limits."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


class QwenVideoProcessor(NumpyVideoProcessor):
    """Numpy twin of transformers' ``Qwen2VLVideoProcessor`` (see the module docstring)."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

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

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> "QwenVideoProcessor":
        """The checkpoint's video settings, found where transformers looks: the
        ``video_processor`` entry of processor_config.json, video_preprocessor_config.json,
        then preprocessor_config.json (older checkpoints share the image processor's)."""
        model_path = Path(model_path)
        settings = {}
        processor_config = model_path / "processor_config.json"
        if processor_config.exists():
            settings = json.loads(processor_config.read_text()).get("video_processor") or {}
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if not settings and (model_path / name).exists():
                settings = json.loads((model_path / name).read_text())
        return cls(**settings)

    # -- transformers' video processor interface ---------------------------------------

    def __call__(self, videos: Any, video_metadata: Any = None, return_metadata: bool = False,
                 return_tensors: Any = None, **kwargs: Any):
        from transformers import BatchFeature
        from transformers.video_utils import VideoMetadata, make_batched_videos

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
        if return_metadata:
            if video_metadata is None:
                video_metadata = [VideoMetadata(total_num_frames=len(v)) for v in videos]
            elif not isinstance(video_metadata, (list, tuple)):
                video_metadata = [video_metadata]
            data["video_metadata"] = list(video_metadata)
        return BatchFeature(data, tensor_type=return_tensors,
                            skip_tensor_conversion=["video_metadata"])

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
