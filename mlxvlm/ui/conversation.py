"""Gradio's chat history plus the new message -> mlxvlm chat messages.

Gradio stores a conversation as display messages: a user turn may be split over several
messages (files, then text), and the app's own notices (an error instead of an answer)
sit among the model's answers. The model must see only the conversation proper: turns
merged, notices left out together with the turn they answered (a turn that failed, e.g.
on an unreadable file, would otherwise fail again on every later turn), and every
image decoded so that its content hash can key the prompt-prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from mlxvlm.errors import MlxvlmError
from mlxvlm.media import MediaPolicy
from mlxvlm.ui.media_kinds import MediaKind, kind_of

# The metadata title of the app's notices in the chat. Any message with a metadata title
# is display-only (Gradio shows it as a titled box): a notice is left out with the turn it
# answered, any other (a thinking model's thoughts) alone.
NOTICE_TITLE = "⚠️ Could not answer"


@dataclass
class Conversation:
    messages: list[dict]  # mlxvlm chat messages
    # The images' content hashes in prompt order, for the prompt-prefix cache; None when
    # the conversation holds media the prefix keys cannot describe (video, audio).
    image_hashes: list[str] | None = field(default_factory=list)


def _title(message: dict) -> str | None:
    return (message.get("metadata") or {}).get("title") or None


def _parts(content: Any) -> list[dict]:
    """A display message's content as a list of {"text"} / {"path", "mime_type"} parts."""
    if content is None:
        return []
    if isinstance(content, (str, dict)):
        content = [content]
    parts = []
    for item in content:
        if isinstance(item, str):
            parts.append({"text": item})
        elif isinstance(item, (list, tuple)):  # Gradio's older (path, alt_text) tuples
            if item:
                parts.append({"path": str(item[0]), "mime_type": None})
        elif isinstance(item, dict):
            if item.get("type") == "text" or "text" in item:
                parts.append({"text": item.get("text") or ""})
            else:
                file = item.get("file", item)
                if isinstance(file, dict) and file.get("path"):
                    parts.append({"path": file["path"], "mime_type": file.get("mime_type")})
    return parts


def _file_part(file: Any) -> dict:
    """An attachment of the new message: a path, or Gradio's file data."""
    if isinstance(file, dict):
        return {"path": file.get("path"), "mime_type": file.get("mime_type")}
    return {"path": str(file), "mime_type": None}


def _turns(history: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    """(role, parts) per turn: consecutive messages of one role merged, notices dropped
    with the turn they answered."""
    turns: list[tuple[str, list[dict]]] = []
    for message in history:
        role = message.get("role")
        if role not in ("user", "assistant"):
            continue
        title = _title(message)
        if title == NOTICE_TITLE:
            # Drop the failed turn: the user's request and any partial answer to it.
            while turns and turns[-1][0] == "assistant":
                turns.pop()
            if turns:
                turns.pop()
            continue
        if title:  # thoughts: the turn is the model's, its text is not for the prompt
            if not turns or turns[-1][0] != "assistant":
                turns.append(("assistant", []))
            continue
        parts = _parts(message.get("content"))
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(parts)
        else:
            turns.append((role, parts))
    return turns


def _plain(text: str, placeholders: Sequence[str]) -> str:
    for placeholder in placeholders:
        text = text.replace(placeholder, "")
    return text


def attachment_paths(
    history: Sequence[dict], message: dict | str
) -> tuple[list[str], list[str]]:
    """The paths of the new message's attachments, and of those in the earlier turns the
    model will see (a turn left out with its notice is never read, so not listed)."""
    files = [] if isinstance(message, str) else message.get("files") or []
    new = [str(p["path"]) for p in map(_file_part, files) if p["path"]]
    earlier = [
        str(part["path"])
        for role, parts in _turns(history)
        if role == "user"
        for part in parts
        if "path" in part
    ]
    return new, earlier


def build_conversation(
    history: Sequence[dict],
    message: dict | str,
    kinds: Sequence[MediaKind],
    media_options: MediaPolicy | Mapping[str, Any] | None = None,
    placeholders: Sequence[str] = (),
) -> Conversation:
    """The model's conversation: ``history`` (Gradio messages) and the new ``message``
    (the multimodal textbox's {"text", "files"}). Raises ``MlxvlmError`` (``MediaError``
    for an image that cannot be read or an attachment of a kind the model does not take;
    videos and audio are read later, by ``prepare_inputs``, under ``media_options``, a
    ``MediaPolicy`` or a mapping of its fields).

    ``placeholders``: the model's media placeholder strings (e.g. ``<|image_pad|>``),
    removed from text: the processor expands every one it finds into media tokens, so a
    placeholder typed by the user, or emitted by the model into an answer that goes back
    into the prompt, would leave the prompt with more media slots than media.
    """
    if isinstance(message, str):
        message = {"text": message, "files": []}
    new_parts = [_file_part(file) for file in message.get("files") or []]
    if message.get("text"):
        new_parts.append({"text": message["text"]})
    if not new_parts:
        raise MlxvlmError("the message is empty; type a question or attach a file")

    turns = _turns(history)
    if turns and turns[-1][0] == "user":
        turns[-1][1].extend(new_parts)  # an earlier request that was stopped unanswered
    else:
        turns.append(("user", new_parts))

    conversation = Conversation(messages=[])
    for role, parts in turns:
        if role == "assistant":
            text = _plain("".join(p.get("text", "") for p in parts), placeholders)
            conversation.messages.append({"role": "assistant", "content": text})
            continue
        content = []
        for part in parts:
            if "text" in part:
                text = _plain(part["text"], placeholders)
                if text:
                    content.append({"type": "text", "text": text})
                continue
            kind = kind_of(part["path"], part["mime_type"], kinds)
            if kind.load is None:
                content.extend(kind.parts(part["path"]))
                conversation.image_hashes = None
                continue
            media = kind.load(part["path"], policy=MediaPolicy.of(media_options))
            if conversation.image_hashes is not None:
                conversation.image_hashes.extend(kind.hashes(media))
            content.extend(kind.parts(media))
        conversation.messages.append({"role": "user", "content": content})
    return conversation
