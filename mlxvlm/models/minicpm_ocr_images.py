"""MiniCPM-OCR's image preprocessing without torch: transformers'
``MiniCPMOcrImageProcessor`` (torchvision only) as MiniCPM-V's views with torchvision's
resize (``minicpm_views.py``), with MiniCPM-OCR's settings and outputs.

- ``downsample_mode`` defaults to ``"4x"`` (no window merger: sides multiples of two
  patches, four times the tokens of ``"16x"``).
- ``small_image_upsize``: ``"always"`` (transformers' default) brings a picture small
  enough not to be sliced up to ``scale_resolution``, as MiniCPM-V 4.6 does; ``"never"``
  keeps its size (aligned to the patch grid). ``"adaptive"`` (a glyph-size classifier
  over OpenCV's connected components, per picture and per slice) is refused when the
  processor is built.
"""

from __future__ import annotations

import contextlib
import threading

from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import (
    MiniCPMV4_6ImageProcessorPilKwargs,
)

from mlxvlm.errors import MlxvlmError
from mlxvlm.models.minicpm_views import TorchvisionViews

UPSIZE_MODES = ("always", "never")
# Set on a thread while a processor sizes a sliced picture's slices (always upscaled);
# kept off the processor, whose settings transformers copies and saves.
_SIZING_SLICES = threading.local()


@contextlib.contextmanager
def _sizing_slices():
    _SIZING_SLICES.active = True
    try:
        yield
    finally:
        _SIZING_SLICES.active = False


class MiniCPMOcrImagesKwargs(MiniCPMV4_6ImageProcessorPilKwargs, total=False):
    """MiniCPM-V 4.6's settings and ``small_image_upsize`` (see the module's docstring)."""

    small_image_upsize: str


class MiniCPMOcrImageProcessorPil(TorchvisionViews):
    downsample_mode = "4x"
    small_image_upsize = "always"
    valid_kwargs = MiniCPMOcrImagesKwargs

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.small_image_upsize == "adaptive":
            raise MlxvlmError(
                "MiniCPM-OCR's small_image_upsize 'adaptive' (OpenCV's glyph classifier) is "
                "not supported; set it to 'always' or 'never' in preprocessor_config.json")
        if self.small_image_upsize not in UPSIZE_MODES:
            raise MlxvlmError(f"unknown small_image_upsize {self.small_image_upsize!r} "
                              f"(one of {UPSIZE_MODES})")

    def get_refine_size(self, *args, **kwargs):
        with _sizing_slices():
            return super().get_refine_size(*args, **kwargs)

    def find_best_resize(self, image_size, scale_resolution, patch_size, downsample_mode,
                         allow_upscale: bool = False):
        # The parent upscales the whole picture when it is not sliced; "never" keeps it.
        if self.small_image_upsize == "never" and not getattr(_SIZING_SLICES, "active", False):
            allow_upscale = False
        return super().find_best_resize(image_size, scale_resolution, patch_size,
                                        downsample_mode, allow_upscale)
