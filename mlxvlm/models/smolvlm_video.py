"""SmolVLM2's video preprocessing in numpy, standing in for transformers'
``SmolVLMVideoProcessor`` (which needs torchvision) inside transformers' SmolVLM
processor. Every frame is resized twice with torchvision's antialiased uint8 filter (the
checkpoint's, Lanczos): its longest edge to ``video_size`` keeping the aspect ratio (even
sides), then square to ``max_image_size`` -- a frame is one image tile, never split --
then rescaled and normalized in float32, channels first, with a pixel mask. Frames are
sampled by ``load_video`` as transformers' SmolVLM processor samples
(``frame_sampling = "smolvlm"``: ``fps`` and ``num_frames`` from ``video_sampling``)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mlxvlm.models.processor_utils import NumpyVideoProcessor
from mlxvlm.models.video_resize import resize_uint8

# PIL's (and transformers' PILImageResampling) numbers for the filters torch resamples
FILTERS = {1: "lanczos", 3: "bicubic"}
# transformers' SmolVLM: 4k as the absolute largest side
MAX_IMAGE_SIDE = 4096


def longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """The (height, width) with the longest side at ``longest_edge`` and the aspect ratio
    kept, the other side truncated and made even (SmolVLM's rule)."""
    longest_edge = min(MAX_IMAGE_SIDE, longest_edge)
    if width >= height:
        new_w = longest_edge
        new_h = int(new_w / (width / height))
        new_h += new_h % 2
    else:
        new_h = longest_edge
        new_w = int(new_h * (width / height))
        new_w += new_w % 2
    return max(new_h, 1), max(new_w, 1)


class SmolVLMVideoProcessor(NumpyVideoProcessor):
    """Numpy twin of transformers' ``SmolVLMVideoProcessor``."""

    model_input_names = ["pixel_values", "pixel_attention_mask"]
    frame_sampling = "smolvlm"

    def __init__(self, video_sampling: dict | None = None, size: dict | None = None,
                 max_image_size: dict | None = None, image_mean: Sequence[float] = (0.5,) * 3,
                 image_std: Sequence[float] = (0.5,) * 3, rescale_factor: float = 1 / 255,
                 do_resize: bool = True, do_rescale: bool = True, do_normalize: bool = True,
                 resample: int = 1, do_pad: bool = True, **_: Any):
        sampling = video_sampling or {}
        self.fps = sampling.get("fps", 1)
        self.num_frames = sampling.get("max_frames", 64)
        # as transformers: the processor's size, else video_sampling's video_size
        self.size = dict(size or sampling.get("video_size") or {"longest_edge": 4 * 364})
        self.max_image_size = dict(max_image_size or {"longest_edge": 364})
        if int(resample) not in FILTERS:
            raise NotImplementedError(f"video resampling filter {resample} (only Lanczos and "
                                      "bicubic)")
        self.filter = FILTERS[int(resample)]
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.rescale_factor = rescale_factor
        self.do_resize, self.do_rescale, self.do_normalize = do_resize, do_rescale, do_normalize
        self.do_pad = do_pad

    def __call__(self, videos: Any, video_metadata: Any = None, return_metadata: bool = False,
                 return_tensors: Any = None, **_: Any):
        """Options for sampling (``fps``, ``num_frames``, ``do_sample_frames`` ...) do not
        apply to frames sampled already."""
        from transformers.video_utils import make_batched_videos

        videos = [np.asarray(v) for v in make_batched_videos(videos)]
        processed = [self.preprocess_video(v) for v in videos]
        frames = max(len(v) for v in processed)
        height = max(v.shape[2] for v in processed)
        width = max(v.shape[3] for v in processed)
        pixels = np.zeros((len(processed), frames, 3, height, width), np.float32)
        mask = np.zeros((len(processed), frames, height, width), np.int64)
        for i, video in enumerate(processed):
            t, _, h, w = video.shape
            pixels[i, :t, :, :h, :w] = video
            mask[i, :t, :h, :w] = 1
        data = {"pixel_values": pixels}
        if self.do_pad:
            data["pixel_attention_mask"] = mask
        return self.batch_feature(data, videos, video_metadata, return_metadata, return_tensors)

    def preprocess_video(self, frames: np.ndarray) -> np.ndarray:
        """(T, H, W, 3) uint8 -> (T, 3, side, side) float32."""
        self.check_rgb_frames(frames)
        if self.do_resize:
            height, width = longest_edge_size(frames.shape[1], frames.shape[2],
                                              self.size["longest_edge"])
            frames = resize_uint8(frames, height, width, self.filter)
            side = self.max_image_size["longest_edge"]
            frames = resize_uint8(frames, side, side, self.filter)
        return self.rescale_and_normalize(frames)
