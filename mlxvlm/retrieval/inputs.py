"""What callers pass as a query or document -> ``RetrievalInput``: a string (its text),
a PIL image, or a dict with ``"text"``, ``"image"`` (a path, http(s) URL, data URL, bytes
or a PIL image, loaded by ``mlxvlm.media`` under the caller's policy) or both."""

from __future__ import annotations

import os
from typing import Any, Sequence

from PIL import Image

from mlxvlm.errors import MlxvlmError
from mlxvlm.media.images import load_image
from mlxvlm.media.policy import MediaPolicy
from mlxvlm.retrieval.use import RetrievalInput, RetrievalUse

INPUT_KEYS = ("text", "image")


class RetrievalInputError(MlxvlmError, ValueError):
    """An input that is neither a text, an image nor both (or one the model cannot take)."""


def retrieval_input(value: Any, name: str = "input",
                    policy: MediaPolicy | None = None) -> RetrievalInput:
    """``value`` normalised; ``name`` says which input a refusal is about."""
    if isinstance(value, str):
        return RetrievalInput(text=value)
    if isinstance(value, Image.Image):
        return RetrievalInput(image=load_image(value, policy=policy))
    if not isinstance(value, dict):
        raise RetrievalInputError(
            f"{name}: expected a string, a PIL image or a dict with 'text' and/or 'image', "
            f"got {type(value).__name__}")
    unknown = sorted(set(value) - set(INPUT_KEYS))
    if unknown:
        raise RetrievalInputError(
            f"{name}: unknown key {unknown[0]!r} (an input takes 'text' and/or 'image')")
    text, image = value.get("text"), value.get("image")
    if text is None and image is None:
        raise RetrievalInputError(f"{name}: give a 'text', an 'image' or both")
    if text is not None and not isinstance(text, str):
        raise RetrievalInputError(f"{name}: 'text' must be a string, got {type(text).__name__}")
    if image is not None:
        if not isinstance(image, (str, os.PathLike, bytes, bytearray, Image.Image)):
            raise RetrievalInputError(
                f"{name}: 'image' must be a path, a URL, bytes or a PIL image, got "
                f"{type(image).__name__}")
        image = load_image(image, policy=policy)
    return RetrievalInput(text=text, image=image)


def retrieval_inputs(values: Any, use: RetrievalUse, name: str = "inputs",
                     policy: MediaPolicy | None = None) -> list[RetrievalInput]:
    """A list of inputs (one string, image or dict is a list of one) normalised for
    ``use``: a model that takes a text or an image, not both, refuses both."""
    one = isinstance(values, (str, dict, Image.Image))
    items = [values] if one else values
    if not isinstance(items, Sequence) or isinstance(items, (bytes, bytearray)):
        raise RetrievalInputError(
            f"{name}: expected an input or a list of inputs, got {type(values).__name__}")
    if not items:
        raise RetrievalInputError(f"{name}: the list is empty")
    normalised = []
    for i, value in enumerate(items):
        label = name if one else f"{name}[{i}]"
        item = retrieval_input(value, label, policy)
        check_takes(item, use, label)
        normalised.append(item)
    return normalised


def check_takes(item: RetrievalInput, use: RetrievalUse, name: str) -> None:
    if item.text is not None and item.image is not None and not use.takes_text_with_image:
        raise RetrievalInputError(
            f"{name}: this model embeds a text (a query) or an image (a page), not both "
            "together; pass them as two inputs")
