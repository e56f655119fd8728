"""GLM-4.6V's video preprocessing in numpy: the twin of transformers' torchvision
``Glm46VVideoProcessor`` for the GLM-V family's processor.

Its steps are Qwen3-VL's (``qwen_video.Qwen3VideoProcessor``): the frames resized so that
the whole video -- its frames rounded to whole temporal patches -- fits the pixel budget
(the same ``smart_resize``), rescaled and normalized with CLIP's mean and std, the last
frame repeated to whole temporal patches, and cut into 14-pixel patches in merge-block
order. What differs is the budget's defaults and how frames are picked
(``frame_sampling = "glm46v"``: a rate chosen by the video's length,
``mlxvlm.media.frame_sampling.GlmDynamicSampler``). The processor then writes each frame
pair's image block followed by its timestamp ("2.0 seconds").
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
