"""The text a talker hears, one row per step: rows handed over as the thinker writes them,
then, once the text has ended, a pad row for every step after the last. Both families'
talker streams keep theirs in one of these, and both families' followers of the thinker
find where the answer ends with a ``FirstEnd`` and read the prompt's ids with
``read_prompt_ids``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError


class HeardText:
    def __init__(self):
        self.rows: list[mx.array] = []
        self.ended = False
        self.pad: mx.array | None = None

    def add(self, rows: mx.array) -> None:
        """The next rows of text (rows, hidden), one per step."""
        self.rows.extend(rows[i] for i in range(rows.shape[0]))

    def end(self, pad: mx.array) -> None:
        """No more text: the steps after the last row hear ``pad``."""
        self.pad = pad.reshape(-1)
        self.ended = True

    def has(self, step: int) -> bool:
        """Whether the row step ``step`` hears is given."""
        return self.ended or step < len(self.rows)

    def row(self, step: int) -> mx.array:
        return self.rows[step] if step < len(self.rows) else self.pad


class FirstEnd:
    """The index of the first end-of-sequence token in an answer being written, looked
    for in each token once (a follower's rows stop there)."""

    def __init__(self, eos_ids):
        self.eos_ids = set(eos_ids)
        self.index: int | None = None
        self._checked = 0

    def find(self, generated) -> int | None:
        while self.index is None and self._checked < len(generated):
            if generated[self._checked] in self.eos_ids:
                self.index = self._checked
            self._checked += 1
        return self.index


def read_prompt_ids(tap, prompt_tokens: int) -> np.ndarray:
    """The prompt's token ids as the thinker's tap recorded them (a follower builds the
    talker's prefill from them); refused where the tap lacks them."""
    if any(ids is None for ids in tap.ids):
        raise MlxvlmError("speech output needs the prompt's token ids")
    ids = np.concatenate([np.asarray(i).reshape(-1) for i in tap.ids])
    if len(ids) < prompt_tokens:
        raise MlxvlmError("speech output needs the thinker's states of the whole prompt "
                          "(a reused prompt cache skips them)")
    return ids[:prompt_tokens]
