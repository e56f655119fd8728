"""MiniCPM-V's views of a picture (the whole of it, then its slices) without torch, as
transformers' torchvision processors of the family make them (``MiniCPMOcrImageProcessor``,
``MiniCPMV4_6VideoProcessor``'s frames): MiniCPM-V 4.6's PIL/numpy image processor, which
slices the same way, with torchvision's antialiased bicubic resize of 8-bit pixels
(``video_resize.py``) in place of PIL's, so that the pixels are transformers' own."""

from __future__ import annotations

import numpy as np
from transformers import MiniCPMV4_6ImageProcessorPil
from transformers.image_utils import PILImageResampling, SizeDict

from mlxvlm.models.video_resize import resize_bicubic_uint8


class TorchvisionViews(MiniCPMV4_6ImageProcessorPil):
    def resize(self, image: np.ndarray, size: SizeDict, resample=None, **kwargs) -> np.ndarray:
        """(C, H, W) uint8 pixels resized as torchvision resizes them (bicubic,
        antialiased, in 8-bit arithmetic); other pixels or filters as the parent does."""
        if image.dtype != np.uint8 or resample != PILImageResampling.BICUBIC:
            return super().resize(image, size, resample=resample, **kwargs)
        resized = resize_bicubic_uint8(image.transpose(1, 2, 0), size.height, size.width)
        return np.ascontiguousarray(resized.transpose(2, 0, 1))
