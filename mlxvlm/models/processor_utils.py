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


class NumpyVideoProcessor:
    """Base of mlxvlm's numpy stand-ins for transformers' torchvision video processors."""


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
