"""A conversation -> model inputs plus the mask of the tokens the loss is computed on.

The loss covers every assistant turn (its text and the template's end-of-turn marker) and
nothing else. The turns are found through the chat template itself, never through a magic
token id: for assistant message k, the template renders ``messages[:k]`` with the
generation prompt (everything before the reply) and ``messages[:k + 1]`` (everything up to
the end of the reply); both are prefixes of the whole conversation, so the reply is the
characters between them.

Characters become tokens through the tokenizer's offsets. The processor then expands each
image placeholder into its image tokens (and sometimes markers around them), so the mask
is carried over from the tokenizer's ids to the processor's by aligning the two sequences:
they agree everywhere except at the expansions, which never fall inside a reply.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.prompt import special_tokens_option
from mlxvlm.text.tokenization import chat_template_owner


class MaskingError(MlxvlmError):
    """The conversation cannot be masked (no assistant turn, an inconsistent template...)."""


@dataclass
class EncodedConversation:
    input_ids: np.ndarray  # (L,) int32, the processor's ids
    loss_mask: np.ndarray  # (L,) bool: True where the token belongs to an assistant turn
    features: dict[str, Any] = field(default_factory=dict)  # the processor's other outputs

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        """Tokens predicted with a loss: assistant tokens after the first position."""
        return int(self.loss_mask[1:].sum())


def _template_owner(processor: Any):
    owner = chat_template_owner(processor)
    if owner is not None:
        return owner
    raise MaskingError(
        "this checkpoint has no chat template (chat_template.jinja or in "
        "tokenizer_config.json); fine-tuning needs one to find the assistant turns"
    )


def render(processor: Any, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    return _template_owner(processor).apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )


def assistant_spans(processor: Any, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character ranges of its assistant turns."""
    text = render(processor, messages, add_generation_prompt=False)
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(processor, messages[:k], add_generation_prompt=True) if k else ""
        through = render(processor, messages[: k + 1], add_generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise MaskingError(
                f"the chat template renders message {k} (assistant) differently once "
                "later turns follow, so its reply cannot be located; split the "
                "conversation into one example per assistant turn"
            )
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    if not spans:
        raise MaskingError("no assistant turn with content to learn from")
    return text, spans


def _token_mask(tokenizer: Any, text: str, spans: list[tuple[int, int]]):
    """The tokenizer's ids for ``text`` and whether each token starts inside a span."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise MaskingError(
            "the tokenizer gives no character offsets (a slow tokenizer); fine-tuning "
            "needs a fast (tokenizers-based) one"
        ) from None
    ids = list(encoded["input_ids"])
    starts = np.array([start for start, _ in encoded["offset_mapping"]])
    mask = np.zeros(len(ids), dtype=bool)
    for begin, end in spans:
        mask |= (starts >= begin) & (starts < end)
    return ids, mask


def _carry_mask(text_ids: list[int], text_mask: np.ndarray, model_ids: list[int]) -> np.ndarray:
    """``text_mask`` over the tokenizer's ids -> the same mask over the processor's ids."""
    if text_ids == model_ids:
        return text_mask.copy()
    mask = np.zeros(len(model_ids), dtype=bool)
    carried = 0
    matcher = difflib.SequenceMatcher(None, text_ids, model_ids, autojunk=False)
    for i, j, size in matcher.get_matching_blocks():
        mask[j : j + size] = text_mask[i : i + size]
        carried += int(text_mask[i : i + size].sum())
    if carried != int(text_mask.sum()):
        raise MaskingError(
            "the processor changed the tokens of an assistant turn (an image inside a "
            "reply?); assistant turns must be text"
        )
    return mask


def encode_conversation(
    processor: Any, messages: Sequence[dict], images: Sequence[Any]
) -> EncodedConversation:
    """Template-ready ``messages`` (image parts as ``{"type": "image"}``) and their decoded
    images, in order -> the processor's ids and features, and the loss mask."""
    text, spans = assistant_spans(processor, messages)
    text_ids, text_mask = _token_mask(processor.tokenizer, text, spans)
    # Special tokens as inference adds them (mlxvlm.prompt): a model taught without the
    # BOS its tokenizer adds would then be asked with it.
    outputs = processor(text=[text], images=list(images) or None, return_tensors="np",
                        **special_tokens_option(processor, text))
    input_ids = np.asarray(outputs["input_ids"], dtype=np.int32).reshape(-1)
    loss_mask = _carry_mask(text_ids, text_mask, input_ids.tolist())
    features = {
        name: np.asarray(value)
        for name, value in outputs.items()
        if name != "input_ids" and value is not None
    }
    return EncodedConversation(input_ids, loss_mask, features)
