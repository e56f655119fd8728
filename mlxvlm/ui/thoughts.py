"""A thinking model's answer as the chat shows it: the thoughts in Gradio's folded
thought box (a message with a metadata title), the answer beside it.

The split is the server's (``mlxvlm.text.answer_parts``: ``<think>`` ... ``</think>``
or Gemma 4's ``<|channel>thought`` ... ``<channel|>``, whose special-token markers the
answer's text keeps, for a template that teaches them, held back only where a marker may
still begin), so the
chat and the API agree on what is thought and what is answer. The thoughts are for the
user to read: the next turn's prompt leaves them out (``conversation``), as the
checkpoints' chat templates do with earlier turns' reasoning.
"""

from __future__ import annotations

import time
from typing import Any

from mlxvlm.text.answer_parts import (AnswerSplitter, ThinkFormat, as_think_format, marker_ids,
                                        think_format)
from mlxvlm.text.tokenization import chat_template_text, tokenizer_of

# The metadata title of a thought box; conversation.py leaves such messages out of the
# model's view (the answer beside them stays).
THOUGHTS_TITLE = "💭 Thinking"


def template_thinks(processor: Any) -> ThinkFormat | None:
    """The thinking format the checkpoint's chat template teaches (None: none)."""
    return think_format(chat_template_text(processor))


def kept_token_ids(processor: Any, fmt: ThinkFormat | None) -> frozenset[int]:
    """The special tokens the answer's text keeps for the split (Gemma 4's markers)."""
    return marker_ids(tokenizer_of(processor), fmt)


class ThoughtsAndAnswer:
    """Feed the answer's text as it streams (``feed``), then ``finish``; ``reply`` is what
    the chat shows now: the plain answer text while there are no thoughts, else the
    thought box (pending until the thoughts end) and the answer."""

    def __init__(self, thinking: ThinkFormat | bool | None, prompt_text: str = ""):
        thinking = as_think_format(thinking)
        # A template that ends its generation prompt with <think> already opened the block.
        reasoning_first = thinking is not None and thinking.opened_by(prompt_text)
        self.splitter = AnswerSplitter(None, thinking, reasoning_first)
        self.thoughts = ""
        self.answer = ""
        self.thinking_now = reasoning_first
        self._started = time.perf_counter()
        self._thought_for: float | None = None

    def _take(self, parts) -> None:
        for part in parts:
            if part.kind == "reasoning":
                self.thoughts += part.text
            else:  # tool calls are not asked for: any other part is answer text
                self.answer += part.text
                self._thoughts_ended()
        self.thinking_now = self.splitter.state == "reasoning"
        if not self.thinking_now and self.thoughts:
            self._thoughts_ended()

    def _thoughts_ended(self) -> None:
        if self._thought_for is None and self.thoughts:
            self._thought_for = time.perf_counter() - self._started

    def feed(self, text: str) -> None:
        self._take(self.splitter.feed(text))

    def finish(self) -> None:
        self._take(self.splitter.finish())
        self.thinking_now = False
        self._thoughts_ended()

    def reply(self) -> Any:
        if not self.thoughts:
            return self.answer or []
        metadata: dict[str, Any] = {"title": THOUGHTS_TITLE}
        if self.thinking_now:
            metadata["status"] = "pending"
        else:
            metadata.update(status="done", duration=round(self._thought_for or 0.0, 2))
        messages = [{"role": "assistant", "content": self.thoughts.strip("\n"),
                     "metadata": metadata}]
        if self.answer:
            messages.append({"role": "assistant", "content": self.answer})
        return messages
