"""The kinds of attachment the chat accepts, as data: one row per kind.

A kind is offered when the model consumes its processor features and its processor has
the part that prepares it (as ``mlxvlm.prompt`` requires). A row also says whether the
chat decodes an attachment itself, to hash its content for the prompt-prefix cache
(images, and a PDF's pages, which become images of the turn), or leaves it to
``prepare_inputs`` as a path (videos and audio, which the prefix keys cannot describe, so
that a conversation holding one is not reused).
"""

from __future__ import annotations

import mimetypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from mlxvlm.media import MediaError, load_image, load_pdf
from mlxvlm.batching.prefix_cache import image_hash

# Pages of one uploaded PDF: each is rendered and becomes an image of the turn, so a long
# document is refused rather than turned into hundreds of images.
UI_MAX_PDF_PAGES = 16


def load_pdf_pages(path: str, *, policy: Any) -> list:
    return load_pdf(path, policy=policy, max_pages=UI_MAX_PDF_PAGES,
                    pages_option=f"split it into PDFs of at most {UI_MAX_PDF_PAGES} pages")


@dataclass(frozen=True)
class MediaKind:
    # Also the message part type (``mlxvlm.prompt``) and Gradio's file-type category.
    name: str
    features: frozenset[str]  # processor outputs that show the model takes this kind
    # the processor attribute that prepares it (the first one the processor has)
    processor_parts: tuple[str, ...]
    # (path, policy=MediaPolicy) -> decoded media, and its content hash; None: the path goes
    # into the message and ``prepare_inputs`` decodes it.
    load: Callable[..., Any] | None = None
    content_hash: Callable[[Any], str] | None = None
    # A document kind: its files' type (what Gradio's file picker filters on, and what
    # ``matches`` takes), and ``load`` gives a list of images, one part each.
    document_type: str | None = None

    @property
    def file_type(self) -> str:
        """Gradio's file type: a category (``image``) or a suffix (``.pdf``)."""
        return f".{self.name}" if self.document_type else self.name

    def matches(self, path: str, mime_type: str | None) -> bool:
        mime = mime_type or mimetypes.guess_type(path)[0] or ""
        if self.document_type:
            return mime == self.document_type or path.lower().endswith(self.file_type)
        return mime.startswith(self.name + "/")

    def parts(self, media: Any) -> list[dict]:
        """The chat message content parts for a decoded attachment (a document's pages:
        one image part each) or a path."""
        if self.document_type:
            return [{"type": "image", "image": page} for page in media]
        return [{"type": self.name, self.name: media}]

    def hashes(self, media: Any) -> list[str]:
        return [self.content_hash(m) for m in (media if self.document_type else [media])]


MEDIA_KINDS: tuple[MediaKind, ...] = (
    MediaKind(
        name="image",
        # Phi-4-multimodal names its pixels image_pixel_values
        features=frozenset({"pixel_values", "image_pixel_values"}),
        processor_parts=("image_processor",),
        load=load_image,
        content_hash=image_hash,
    ),
    MediaKind(
        name="pdf",
        features=frozenset({"pixel_values", "image_pixel_values"}),
        processor_parts=("image_processor",),
        load=load_pdf_pages,
        content_hash=image_hash,
        document_type="application/pdf",
    ),
    MediaKind(
        name="video",
        features=frozenset({"pixel_values_videos"}),
        processor_parts=("video_processor",),
    ),
    MediaKind(
        name="audio",
        # Phi-4-multimodal: audio_input_features from its audio_processor
        features=frozenset({"input_features", "audio_input_features"}),
        processor_parts=("feature_extractor", "audio_processor"),
    ),
)


def supported_kinds(model: Any, processor: Any) -> tuple[MediaKind, ...]:
    """The kinds this model and its processor take."""
    features = set(getattr(model, "feature_names", ()))
    return tuple(
        kind
        for kind in MEDIA_KINDS
        if kind.features & features
        and any(getattr(processor, part, None) is not None for part in kind.processor_parts)
    )


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
