"""LLaVA-OneVision's video preprocessing in numpy, standing in for transformers'
``LlavaOnevisionVideoProcessor`` (which needs torchvision) inside the transformers
processor: every frame resized to ``size`` (384 x 384) with torchvision's antialiased
bicubic filter for uint8 frames, then rescaled and normalized in float32, channels first.
Frames are sampled by ``load_video`` as transformers' ``BaseVideoProcessor`` samples
(``frame_sampling = "step"``)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mlxvlm.models.processor_utils import NumpyVideoProcessor
from mlxvlm.models.qwen_video import CLIP_MEAN, CLIP_STD
from mlxvlm.models.video_resize import BICUBIC, resize_bicubic_uint8


class OnevisionVideoProcessor(NumpyVideoProcessor):
    """Numpy twin of transformers' ``LlavaOnevisionVideoProcessor``."""

    model_input_names = ["pixel_values_videos"]
    frame_sampling = "step"

    def __init__(self, size: dict | None = None, image_mean: Sequence[float] = CLIP_MEAN,
                 image_std: Sequence[float] = CLIP_STD, rescale_factor: float = 1 / 255,
                 do_resize: bool = True, do_rescale: bool = True, do_normalize: bool = True,
                 resample: int = BICUBIC, fps: float | None = None,
                 num_frames: int | None = None, **_: Any):
        self.size = dict(size or {"height": 384, "width": 384})
        if "height" not in self.size or "width" not in self.size:
            raise NotImplementedError(f"video size {self.size} (only height and width are "
                                      "supported, as every LLaVA-OneVision checkpoint has)")
        if int(resample) != BICUBIC:
            raise NotImplementedError(f"video resampling filter {resample} (only bicubic)")
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.rescale_factor = rescale_factor
        self.do_resize, self.do_rescale, self.do_normalize = do_resize, do_rescale, do_normalize
        self.fps, self.num_frames = fps, num_frames

    def __call__(self, videos: Any, video_metadata: Any = None, return_metadata: bool = False,
                 return_tensors: Any = None, **_: Any):
        """Options transformers' processor passes for sampling (``fps``, ``num_frames``,
        ``do_sample_frames`` ...) do not apply to frames sampled already."""
        from transformers.video_utils import make_batched_videos

        videos = [np.asarray(v) for v in make_batched_videos(videos)]
        pixels = np.stack([self.preprocess_video(v) for v in videos]) if len(
            {v.shape for v in videos}) == 1 else [self.preprocess_video(v) for v in videos]
        return self.batch_feature({"pixel_values_videos": pixels}, videos, video_metadata,
                                  return_metadata, return_tensors)

    def preprocess_video(self, frames: np.ndarray) -> np.ndarray:
        """(T, H, W, 3) uint8 -> (T, 3, height, width) float32."""
        self.check_rgb_frames(frames)
        if self.do_resize:
            frames = resize_bicubic_uint8(frames, self.size["height"], self.size["width"])
        return self.rescale_and_normalize(frames)
