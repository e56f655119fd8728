"""Build transformers processors without torch or torchvision.

``AutoProcessor`` fails for families whose video processor needs torchvision, and a
processor class refuses a video processor that is not transformers' own (it checks every
sub-processor against its expected base class). ``image_only`` returns a subclass that
accepts a missing video processor (images and text only) or one of mlxvlm's numpy video
processors (``NumpyVideoProcessor``, e.g. ``mlxvlm.models.qwen_video``), so the processor
can be built from the tokenizer, the PIL image processor and a numpy video processor.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np


class NumpyVideoProcessor:
    """Base of mlxvlm's numpy stand-ins for transformers' torchvision video processors.

    A subclass names how its transformers twin samples frames in ``frame_sampling`` (see
    ``mlxvlm.media.frame_sampling``) and holds that way's settings as attributes."""

    frame_sampling = "spread"

    @classmethod
    def from_pretrained(cls, model_path: str | Path):
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

    @staticmethod
    def check_rgb_frames(frames: np.ndarray) -> None:
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"expected RGB frames of shape (T, H, W, 3), got {frames.shape}")

    def rescale_and_normalize(self, frames: np.ndarray) -> np.ndarray:
        """(T, H, W, 3) uint8 -> (T, 3, H, W) float32, rescaled and normalized as the
        subclass's ``do_rescale``/``do_normalize`` say. Both at once scale the mean and
        std instead of the pixels, as transformers fuses them."""
        pixels = frames.astype(np.float32)
        if self.do_normalize:
            scale = np.float32(1.0 / self.rescale_factor) if self.do_rescale else np.float32(1)
            pixels = (pixels - np.asarray(self.image_mean, np.float32) * scale) / (
                np.asarray(self.image_std, np.float32) * scale)
        elif self.do_rescale:
            pixels = pixels * np.float32(self.rescale_factor)
        return np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))

    @staticmethod
    def batch_feature(data: dict, videos: list, video_metadata, return_metadata: bool,
                      return_tensors):
        """``data`` as transformers' video processors return it, with the videos'
        metadata when asked (made up from the frame counts when none was given)."""
        from transformers import BatchFeature
        from transformers.video_utils import VideoMetadata

        if return_metadata:
            if video_metadata is None:
                video_metadata = [VideoMetadata(total_num_frames=len(v)) for v in videos]
            elif not isinstance(video_metadata, (list, tuple)):
                video_metadata = [video_metadata]
            data["video_metadata"] = list(video_metadata)
        return BatchFeature(data, tensor_type=return_tensors,
                            skip_tensor_conversion=["video_metadata"])


@functools.cache
def image_only(processor_class: type) -> type:
    """``processor_class`` accepting ``video_processor=None`` (images and text only) or a
    ``NumpyVideoProcessor``."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and (
            argument is None or isinstance(argument, NumpyVideoProcessor)
        ):
            return None
        return processor_class.check_argument_for_proper_class(self, argument_name, argument)

    return type(
        processor_class.__name__,
        (processor_class,),
        {
            "check_argument_for_proper_class": check_argument_for_proper_class,
            "__doc__": f"{processor_class.__name__} without torchvision's video processor.",
        },
    )


def read_chat_template(model_path: str | Path) -> str | None:
    """The checkpoint's chat template from chat_template.jinja (transformers 5) or
    chat_template.json (older Hub checkpoints); None if neither exists."""
    model_path = Path(model_path)
    jinja = model_path / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    legacy = model_path / "chat_template.json"
    if legacy.exists():
        return json.loads(legacy.read_text()).get("chat_template")
    return None


def tokenizer_and_chat_template(model_path: str | Path):
    """The checkpoint's tokenizer and its chat template: the template file's (see
    ``read_chat_template``), else the one tokenizer_config.json carries (None if neither)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer, read_chat_template(model_path) or getattr(tokenizer, "chat_template", None)


def pil_processor(model_path: str | Path, processor_class: str, image_processor_class: str):
    """transformers' ``processor_class`` (its exported name) from the checkpoint, over its
    tokenizer and the PIL ``image_processor_class``: passing the image processor keeps
    ``from_pretrained`` from reaching for the torchvision one."""
    import transformers

    return getattr(transformers, processor_class).from_pretrained(
        model_path,
        tokenizer=transformers.AutoTokenizer.from_pretrained(model_path),
        image_processor=getattr(transformers, image_processor_class).from_pretrained(model_path),
    )
