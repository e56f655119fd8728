"""InternVL's video preprocessing in numpy, standing in for transformers'
``InternVLVideoProcessor`` (which needs torchvision) inside transformers'
``InternVLProcessor``: every frame is resized to ``size`` with torchvision's antialiased
uint8 filter (the checkpoint's, bicubic), then rescaled and normalized in float32,
channels first -- each frame one tile, never cut. Frames are sampled by ``load_video``
as InternVL's processor samples them (``frame_sampling = "internvl"``: half a step in,
``initial_shift``)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mlxvlm.models.processor_utils import NumpyVideoProcessor
from mlxvlm.models.video_resize import resize_uint8

# PIL's (and transformers' PILImageResampling) numbers for the filters torch resamples
FILTERS = {1: "lanczos", 3: "bicubic"}
# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, the processor's defaults
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class FrameStack(np.ndarray):
    """Videos' frames, (videos, frames, C, H, W). ``InternVLProcessor`` joins them with
    torch's ``flatten(0, 1)``; this array answers that call as torch does (numpy's
    ``flatten`` takes a memory order), so the processor runs on numpy."""

    def flatten(self, start_dim: Any = 0, end_dim: Any = -1):  # noqa: A003 (torch's name)
        if isinstance(start_dim, str):  # numpy's own flatten(order)
            return np.asarray(self).flatten(start_dim)
        shape = self.shape
        start, end = start_dim % len(shape), end_dim % len(shape)
        merged = int(np.prod(shape[start:end + 1]))
        return np.asarray(self).reshape(shape[:start] + (merged,) + shape[end + 1:])


class InternVLVideoProcessor(NumpyVideoProcessor):
    """Numpy twin of transformers' ``InternVLVideoProcessor``."""

    model_input_names = ["pixel_values_videos"]
    frame_sampling = "internvl"

    def __init__(self, size: dict | None = None, resample: int = 3,
                 image_mean: Sequence[float] = CLIP_MEAN, image_std: Sequence[float] = CLIP_STD,
                 rescale_factor: float = 1 / 255, do_resize: bool = True,
                 do_rescale: bool = True, do_normalize: bool = True,
                 initial_shift: bool | float = True, num_frames: int | None = None,
                 fps: float | None = None, do_center_crop: bool = False, **_: Any):
        if do_center_crop:
            raise NotImplementedError("InternVL's video processor with do_center_crop")
        size = dict(size or {"height": 384, "width": 384})
        if "height" not in size or "width" not in size:
            raise NotImplementedError(f"InternVL's video processor with size {size}")
        self.size = size
        if int(resample) not in FILTERS:
            raise NotImplementedError(f"video resampling filter {resample} (only Lanczos and "
                                      "bicubic)")
        self.filter = FILTERS[int(resample)]
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.rescale_factor = rescale_factor
        self.do_resize, self.do_rescale, self.do_normalize = do_resize, do_rescale, do_normalize
        self.initial_shift, self.num_frames, self.fps = initial_shift, num_frames, fps

    def __call__(self, videos: Any, video_metadata: Any = None, return_metadata: bool = False,
                 return_tensors: Any = None, **_: Any):
        """Options for sampling (``fps``, ``num_frames``, ``do_sample_frames`` ...) do not
        apply to frames sampled already. The frames stay a ``FrameStack`` (not converted
        to ``return_tensors``) for the processor to join them."""
        from transformers.video_utils import make_batched_videos

        videos = [np.asarray(v) for v in make_batched_videos(videos)]
        processed = [self.preprocess_video(v) for v in videos]
        if len({v.shape for v in processed}) != 1:
            # transformers' processor stacks them too: one length for all videos of a call
            raise ValueError("InternVL's processor takes videos of one frame count per call")
        stack = np.stack(processed).view(FrameStack)
        return self.batch_feature({"pixel_values_videos": stack}, videos, video_metadata,
                                  return_metadata, None)

    def preprocess_video(self, frames: np.ndarray) -> np.ndarray:
        """(T, H, W, 3) uint8 -> (T, 3, height, width) float32."""
        self.check_rgb_frames(frames)
        if self.do_resize:
            frames = resize_uint8(frames, self.size["height"], self.size["width"], self.filter)
        return self.rescale_and_normalize(frames)
