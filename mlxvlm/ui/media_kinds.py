"""The kinds of attachment the chat accepts, as data: one row per kind.

A kind is offered when the model consumes its processor features, and each row says how
to load an uploaded file of that kind, how it enters a chat message, and how its content
is hashed (so that a prompt-prefix cache can tell two attachments apart). Video and audio
become rows here once the prompt layer takes their message parts.
"""

from __future__ import annotations

import mimetypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from mlxvlm.media import MediaError, load_image
from mlxvlm.prefix_cache import image_hash


@dataclass(frozen=True)
class MediaKind:
    name: str  # also Gradio's file-type category ("image", "video", "audio")
    features: frozenset[str]  # processor outputs that show a model takes this kind
    load: Callable[..., Any]  # (path, **limits) -> the decoded media
    part: Callable[[Any], dict]  # decoded media -> a chat message content part
    content_hash: Callable[[Any], str]

    def matches(self, path: str, mime_type: str | None) -> bool:
        mime = mime_type or mimetypes.guess_type(path)[0] or ""
        return mime.startswith(self.name + "/")


MEDIA_KINDS: tuple[MediaKind, ...] = (
    MediaKind(
        name="image",
        features=frozenset({"pixel_values"}),
        load=load_image,
        part=lambda image: {"type": "image", "image": image},
        content_hash=image_hash,
    ),
)


def supported_kinds(model: Any) -> tuple[MediaKind, ...]:
    """The kinds this model takes, judged by the processor features its ``embed`` reads."""
    features = set(getattr(model, "feature_names", ()))
    return tuple(kind for kind in MEDIA_KINDS if kind.features & features)


def kind_of(path: str, mime_type: str | None, kinds: Sequence[MediaKind]) -> MediaKind:
    """The kind of an uploaded file, or a ``MediaError`` naming what the model takes."""
    for kind in kinds:
        if kind.matches(path, mime_type):
            return kind
    offered = ", ".join(k.name for k in kinds) or "no attachments (text only)"
    raise MediaError(
        f"{Path(path).name}: this kind of file cannot be attached; this model takes "
        f"{offered}"
    )
