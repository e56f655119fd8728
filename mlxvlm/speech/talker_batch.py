"""The talkers of one talker model stepped together (for ``SpeechBatch``): each talker,
once prefilled on its own (B=1), hands its KV cache over as a row of the batch's
(``TalkerRows``); a step is then the family's ``step_all`` over the ready talkers, one
forward pass per stage for all of them (Qwen3-Omni: each of the code predictor's group
passes, then the talker's), each row drawing its codes with its own sampling and seed,
as it would alone. A talker's row is freed when it leaves."""

from __future__ import annotations

from typing import Hashable

import mlx.core as mx
import numpy as np

from mlxvlm.speech.talker_rows import TalkerRows


class TalkerBatch:
    def __init__(self, stream):
        self.talker = stream.talker
        self.step_all = type(stream).step_all
        self.rows = TalkerRows(len(stream.talker.model.layers))
        self.keys: list[Hashable] = []  # by row
        self._row_of: dict[int, int] = {}  # a stepping stream's id -> its row

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.keys

    def admit(self, key: Hashable, stream) -> None:
        """A prefilled talker's cache becomes a row; the talker keeps none of its own."""
        if not stream.started:
            raise RuntimeError("a talker joins the batch once its prefill is done")
        self.rows.add(stream.cache)
        stream.cache = None
        self.keys.append(key)

    def drop(self, key: Hashable) -> None:
        """Talker ``key``'s row freed (it ended, failed or left)."""
        if key in self.keys:
            row = self.keys.index(key)
            del self.keys[row]
            self.rows.keep([i for i in range(len(self.rows)) if i != row])

    def step(self, streams: dict[Hashable, object]) -> dict[Hashable, np.ndarray | None]:
        """One frame of each of ``streams`` (ready talkers of this model, by key): the
        family's frame, or None for a talker that has ended. Talkers not yet in the batch
        join it first (their prefill done)."""
        for key, stream in streams.items():
            if key not in self.keys and not stream.finished:
                self.admit(key, stream)
        self._row_of = {id(stream): self.keys.index(key) for key, stream in streams.items()
                        if key in self.keys}
        try:
            frames = self.step_all(list(streams.values()), self._forward)
        finally:
            self._row_of = {}
        return dict(zip(streams, frames))

    def _forward(self, call, streams, inputs: mx.array, positions: mx.array) -> mx.array:
        rows = [self._row_of[id(stream)] for stream in streams]
        return self.rows.forward(call, inputs, positions, rows)
