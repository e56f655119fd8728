"""Messages (text and image parts) -> model inputs, through the model's own chat template.

Accepted message shapes (OpenAI's and transformers'):

    {"role": "user", "content": "plain text"}
    {"role": "user", "content": [
        {"type": "text", "text": "What is in"},
        {"type": "image", "image": "cat.jpg"},          # also "url" / "path"
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
        {"type": "image"},                              # next item of the image= argument
    ]}

Images are fed to the processor in the order they appear across the conversation, so an
image in a later turn lands at its own placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.media import load_image

Message = dict[str, Any]


@dataclass
class PreparedInputs:
    input_ids: mx.array  # (1, L) int32
    features: dict[str, mx.array] = field(default_factory=dict)
    prompt_text: str = ""
    num_images: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def build_messages(
    prompt: str | Sequence[Message], num_images: int = 0, system: str | None = None
) -> list[Message]:
    """A plain prompt becomes one user turn with the images before the text."""
    if isinstance(prompt, str):
        content = [{"type": "image"} for _ in range(num_images)]
        content.append({"type": "text", "text": prompt})
        messages: list[Message] = [{"role": "user", "content": content}]
    else:
        messages = list(prompt)
    if system is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _image_source(part: dict) -> Any:
    if part.get("type") == "image_url" or "image_url" in part:
        ref = part.get("image_url")
        return ref.get("url") if isinstance(ref, dict) else ref
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    return None


def normalize_messages(
    messages: Iterable[Message], extra_images: Sequence[Any] = ()
) -> tuple[list[Message], list[Any]]:
    """Template-ready messages (image parts reduced to {"type": "image"}) and the image
    sources in prompt order. Parts without a source take the next of ``extra_images``."""
    pending = list(extra_images)
    sources: list[Any] = []
    normalized: list[Message] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise MlxvlmError(f"message {index} must be a dict with a 'role' and 'content'")
        content = message.get("content")
        if content is None or isinstance(content, str):
            normalized.append(dict(message))
            continue
        parts = []
        for part in _as_list(content):
            if isinstance(part, str):
                part = {"type": "text", "text": part}
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in ("image", "image_url"):
                source = _image_source(part)
                if source is None:
                    if not pending:
                        raise MlxvlmError(
                            f"message {index} has an image part with no image; "
                            "give it an 'image' (path, URL or data URL) or pass image=..."
                        )
                    source = pending.pop(0)
                sources.append(source)
                parts.append({"type": "image"})
            else:
                raise MlxvlmError(
                    f"message {index} has a content part of unsupported type {kind!r} "
                    "(supported: text, image, image_url)"
                )
        normalized.append({**message, "content": parts})
    if pending:
        raise MlxvlmError(
            f"{len(pending)} image(s) were passed but the messages have no image part left "
            "to place them"
        )
    return normalized, sources


def render_chat(processor: Any, messages: list[Message]) -> str:
    template_owner = processor if getattr(processor, "chat_template", None) else None
    tokenizer = processor.tokenizer
    if template_owner is None and getattr(tokenizer, "chat_template", None):
        template_owner = tokenizer
    if template_owner is None:
        raise MlxvlmError(
            "this checkpoint has no chat template (chat_template.jinja or in "
            "tokenizer_config.json); add one, or pass a raw prompt with raw_prompt=True"
        )
    return template_owner.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def prepare_inputs(
    processor: Any,
    prompt: str | Sequence[Message],
    image: Any = None,
    *,
    system: str | None = None,
    raw_prompt: bool = False,
    feature_names: Sequence[str] | None = None,
    media_options: dict | None = None,
) -> PreparedInputs:
    """Render the conversation with the chat template and run the processor.

    ``raw_prompt``: ``prompt`` is already the model's exact input text (images must then
    be given with ``image=`` and the text must contain the placeholders).
    """
    extra_images = _as_list(image)
    if raw_prompt:
        if not isinstance(prompt, str):
            raise MlxvlmError("raw_prompt=True needs the prompt as a string")
        text, sources = prompt, extra_images
    else:
        messages = build_messages(prompt, len(extra_images), system)
        messages, sources = normalize_messages(messages, extra_images)
        text = render_chat(processor, messages)

    images = [load_image(source, **(media_options or {})) for source in sources]
    outputs = processor(
        text=[text],
        images=images or None,
        return_tensors="np",
        add_special_tokens=raw_prompt,
    )
    input_ids = mx.array(np.asarray(outputs["input_ids"]), dtype=mx.int32)
    features = {}
    for name, value in outputs.items():
        if name == "input_ids" or value is None:
            continue
        if feature_names is not None and name not in feature_names:
            continue
        features[name] = mx.array(np.asarray(value))
    return PreparedInputs(input_ids, features, text, len(images))
