"""A thinking budget: once a thinking model has thought for ``budget`` tokens without
closing its thoughts, the end-of-thinking tag of the template's format is forced
(``</think>`` token by token, where the tokenizer spells it with several; Gemma 4's
``<channel|>``), and the model goes on to its answer.

Thinking starts where the prompt opened the thinking block (a template's generation
prompt ending in ``<think>``, as ``AnswerPlan`` reads it) or where the model opens it;
it ends at the model's own closing tag, after which the budget does nothing more. Each sequence gets its own
``ThinkingBudgetProcessor`` (``SamplingOptions.extra_processors``), which sees the
tokens fed back, as every logits processor does.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxvlm.sampling.constrained import ends_with, tag_progress
from mlxvlm.text.answer_parts import THINK, ThinkFormat


def tag_ids(tokenizer: Any, tag: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(tag, add_special_tokens=False))


class ThinkingBudget:
    """At most ``budget`` thinking tokens, for the sequences of one tokenizer."""

    def __init__(self, tokenizer: Any, budget: int, fmt: ThinkFormat = THINK):
        self.tokenizer = tokenizer
        self.budget = budget
        self.format = fmt
        self.open_ids = tag_ids(tokenizer, fmt.open)
        self.close_ids = tag_ids(tokenizer, fmt.close)

    def processor(self, max_tokens: int) -> "ThinkingBudgetProcessor":
        return ThinkingBudgetProcessor(self)


class ThinkingBudgetProcessor:
    """One sequence's count of thinking tokens, as a logits processor."""

    def __init__(self, budget: ThinkingBudget):
        self.budget = budget
        self.tokens: list[int] = []  # what it has seen (the tail it needs is enough)
        self.seen = 0
        self.thinking_from: int | None = None  # index of the first thinking token
        self.done = False  # the thoughts were closed: nothing more to do

    def _start(self, history: mx.array) -> None:
        """The prompt: thinking from its end if it ends by opening the block (the tags
        of earlier turns are not this answer's)."""
        budget = self.budget
        tail = np.array(history[..., -(len(budget.open_ids) + 8):]).reshape(-1).tolist()
        text = budget.tokenizer.decode(tail, skip_special_tokens=False)
        self.seen = history.shape[-1]
        if budget.format.opened_by(text):
            self.thinking_from = self.seen
        self.tokens = [int(t) for t in tail]

    def _follow(self, history: mx.array) -> None:
        length = history.shape[-1]
        if self.seen == 0:
            self._start(history)
            return
        if length == self.seen:
            return
        new = np.array(history[..., self.seen:]).reshape(-1).tolist()
        open_ids, close_ids = self.budget.open_ids, self.budget.close_ids
        for token in new:
            self.tokens.append(int(token))
            self.seen += 1
            if self.thinking_from is None and ends_with(self.tokens, open_ids):
                self.thinking_from = self.seen
            elif self.thinking_from is not None and ends_with(self.tokens, close_ids):
                self.done = True
                break
        # Only the last tags' length matters for what comes.
        keep = max(len(open_ids), len(close_ids))
        self.tokens = self.tokens[-keep:]
        self.seen = length

    def _forced(self) -> int | None:
        """The closing tag's next token, once the budget is spent."""
        if self.done or self.thinking_from is None:
            return None
        if self.seen - self.thinking_from < self.budget.budget:
            return None
        # A tag forced part way (or begun by the model) goes on where it is.
        close_ids = self.budget.close_ids
        return close_ids[tag_progress(self.tokens, close_ids)]

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if not self.done:
            self._follow(history)
        forced = self._forced()
        if forced is None:
            return logits
        keep = mx.arange(logits.shape[-1]) == forced
        return mx.where(keep, logits, mx.array(-np.inf, dtype=logits.dtype))
