"""MiniCPM-V 4.6's video preprocessing in numpy, standing in for transformers'
``MiniCPMV4_6VideoProcessor`` (and MiniCPM-OCR's, the same with ``"4x"``; both need
torchvision) inside transformers' processor: every sampled frame is a picture of its own,
resized and cut into slices as an image is (``minicpm_views.py``: the whole frame, then
its slices, with torchvision's uint8 bicubic resize), its views packed as a row of
patches after the previous frame's. The processor then writes each frame's
``<image>...</image>`` run of video tokens (and its slices' runs) after the video's
``<image_id>``.

Frames are sampled by ``load_video`` as the processor samples them (``frame_sampling =
"minicpmv"``: one a second). Stacking sub-second frames into composite pictures
(``stack_frames`` above 1) is refused.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.models.processor_utils import NumpyVideoProcessor

# transformers' IMAGENET_STANDARD_MEAN / _STD, the processor's defaults
STANDARD = (0.5, 0.5, 0.5)


class MiniCPMVideoProcessor(NumpyVideoProcessor):
    """Numpy twin of transformers' ``MiniCPMV4_6VideoProcessor``."""

    model_input_names = ["pixel_values_videos", "target_sizes_videos"]
    frame_sampling = "minicpmv"
    downsample_mode = "16x"  # MiniCPM-OCR's: "4x"

    def __init__(self, max_num_frames: int = 128, stack_frames: int = 1,
                 max_slice_nums: int = 9, scale_resolution: int = 448, patch_size: int = 14,
                 slice_mode: bool = True, downsample_mode: str | None = None,
                 use_image_id: bool = True, resample: int = 3,
                 image_mean: Sequence[float] = STANDARD, image_std: Sequence[float] = STANDARD,
                 rescale_factor: float = 1 / 255, do_resize: bool = True,
                 do_rescale: bool = True, do_normalize: bool = True, **_: Any):
        # transformers' image processors, imported when a checkpoint's processor is built
        from mlxvlm.models.minicpm_views import TorchvisionViews

        if stack_frames and stack_frames > 1:
            raise MlxvlmError(f"MiniCPM-V's video stack_frames {stack_frames} (composite "
                              "pictures of sub-second frames) is not supported; set it to 1")
        if not do_resize:
            raise MlxvlmError("MiniCPM-V's video processor always resizes frames to the patch "
                              "grid (do_resize false is not supported)")
        self.max_num_frames, self.stack_frames = max_num_frames, stack_frames
        self.slice_mode, self.use_image_id = slice_mode, use_image_id
        self.downsample_mode = downsample_mode or self.downsample_mode
        self.views = TorchvisionViews(
            max_slice_nums=max_slice_nums, scale_resolution=scale_resolution,
            patch_size=patch_size, slice_mode=slice_mode, downsample_mode=self.downsample_mode,
            use_image_id=use_image_id, resample=resample, image_mean=list(image_mean),
            image_std=list(image_std), rescale_factor=rescale_factor, do_rescale=do_rescale,
            do_normalize=do_normalize)

    def __call__(self, videos: Any, video_metadata: Any = None, return_metadata: bool = False,
                 return_tensors: Any = None, downsample_mode: str | None = None, **_: Any):
        """Options for sampling do not apply to frames sampled already."""
        from transformers.video_utils import make_batched_videos

        videos = [np.asarray(v) for v in make_batched_videos(videos)]
        pixels, sizes, grids, views_per_frame, frames_per_video = [], [], [], [], []
        for frames in videos:
            self.check_rgb_frames(frames)
            views = self.views(list(frames), input_data_format="channels_last",
                               downsample_mode=downsample_mode or self.downsample_mode)
            pixels.append(np.asarray(views["pixel_values"]))
            sizes.append(np.asarray(views["target_sizes"]))
            grids += views["grids"]
            views_per_frame += views["num_patches_per_image"]
            frames_per_video.append(len(frames))
        data = {
            "pixel_values_videos": np.concatenate(pixels, axis=-1),
            "target_sizes_videos": np.concatenate(sizes).astype(np.int32),
            "grids_videos": np.asarray(grids, dtype=np.int32).reshape(-1, 2),
            "num_patches_per_frame": np.asarray(views_per_frame, dtype=np.int32),
            "num_frames_per_video": frames_per_video,
        }
        return self.batch_feature(data, videos, video_metadata, return_metadata, None)


class MiniCPMOcrVideoProcessor(MiniCPMVideoProcessor):
    """Numpy twin of transformers' ``MiniCPMOcrVideoProcessor``."""

    downsample_mode = "4x"
