"""GLM-V's video preprocessing in numpy: twins of transformers' torchvision
``Glm46VVideoProcessor`` (GLM-4.6V) and ``Glm4vVideoProcessor`` (GLM-4.1V, GLM-4.5V) for
the GLM-V family's processors.

Its steps are Qwen3-VL's (``qwen_video.Qwen3VideoProcessor``): the frames resized so that
the whole video -- its frames rounded to whole temporal patches -- fits the pixel budget
(the same ``smart_resize``), rescaled and normalized with CLIP's mean and std, the last
frame repeated to whole temporal patches, and cut into 14-pixel patches in merge-block
order. What differs is the budget's defaults and how frames are picked: GLM-4.6V's at a
rate chosen by the video's length (``frame_sampling = "glm46v"``,
``mlxvlm.media.frame_sampling.GlmDynamicSampler``), GLM-4.1V's at the fps asked (2 by
default, ``"glm4v"``, ``GlmFpsSampler``). The processor then writes each frame pair's
image block followed by its timestamp (GLM-4.6V's "2.0 seconds", GLM-4.1V's "2").
"""

from __future__ import annotations

from typing import Any, Sequence

from mlxvlm.models.qwen_video import CLIP_MEAN, CLIP_STD, Qwen3VideoProcessor

# transformers' Glm46VVideoProcessor defaults
DEFAULT_SIZE = {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 30000}


class Glm46VVideoProcessor(Qwen3VideoProcessor):
    frame_sampling = "glm46v"

    def __init__(self, size: dict | None = None, patch_size: int = 14,
                 image_mean: Sequence[float] = CLIP_MEAN, image_std: Sequence[float] = CLIP_STD,
                 fps: float | None = None, **settings: Any):
        super().__init__(size=dict(size or DEFAULT_SIZE), patch_size=patch_size,
                         image_mean=image_mean, image_std=image_std, fps=fps,
                         cap_pixels_per_frame=False, **settings)


class Glm4vVideoProcessor(Glm46VVideoProcessor):
    """GLM-4.1V's: GLM-4.6V's steps, frames at the fps asked (2 by default), a video
    longer than ``max_duration`` seconds spread instead."""

    frame_sampling = "glm4v"

    def __init__(self, fps: float | None = 2, max_duration: float = 300, **settings: Any):
        super().__init__(fps=fps, **settings)
        self.max_duration = max_duration
