"""A decoder's hidden states kept as it runs: the token ids fed, their input embeddings
(after any media features are merged in) and one layer's output, for a second model
that is conditioned on them (Qwen3-Omni's talker reads the thinker's).

A decoder that supports it (``Qwen2MRopeModel``) records into the ``HiddenTap`` set as
its ``hidden_tap`` on every forward pass: prefill chunks and decode steps alike, in
order, so the records cover the positions fed so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class TapRecords:
    """What a tap recorded for a prompt's first positions, kept whole (one array each)
    with the prefix-cache entry of those positions: a later spoken turn sharing them
    starts its tap from these (``HiddenTap.resuming``) instead of prefilling them again.
    The position state is not among them: the reusing request's own state (the entry's
    state cut to the prefix, or its prompt's) covers every position from 0."""

    layer: int
    ids: mx.array  # (1, n)
    embeddings: mx.array  # (1, n, width)
    hidden: mx.array | None  # (1, n, width); None when ``layer`` is 0 (the embeddings)

    @property
    def length(self) -> int:
        return self.embeddings.shape[1]

    @property
    def nbytes(self) -> int:
        hidden = 0 if self.hidden is None else self.hidden.nbytes
        return self.ids.nbytes + self.embeddings.nbytes + hidden

    def cut(self, length: int) -> "TapRecords":
        """The records of the first ``length`` positions."""
        if length == self.length:
            return self
        hidden = None if self.hidden is None else self.hidden[:, :length]
        return TapRecords(self.layer, self.ids[:, :length], self.embeddings[:, :length], hidden)


class HiddenTap:
    """Records, per forward pass, the ids (None when only embeddings were given), the
    input embeddings, the first position state given and the output of ``layer`` (transformers' ``hidden_states[layer]``:
    0 the embeddings, ``i`` the output of layer ``i - 1``, the last one after the norm)."""

    def __init__(self, layer: int):
        self.layer = layer
        self.ids: list[mx.array | None] = []
        self.embeddings: list[mx.array] = []
        self.hidden: list[mx.array] = []
        self.state = None  # the prompt's position state (an MRopeState), when it has one

    @classmethod
    def resuming(cls, records: TapRecords) -> "HiddenTap":
        """A tap holding ``records`` as its first positions, recording the rest as a tap
        does (its position state: the first one its passes give)."""
        tap = cls(records.layer)
        tap.ids.append(records.ids)
        tap.embeddings.append(records.embeddings)
        tap.hidden.append(records.embeddings if records.hidden is None else records.hidden)
        return tap

    def records(self) -> TapRecords | None:
        """Every position recorded so far, evaluated into one array each (None when a pass
        gave no ids: a prompt key names tokens)."""
        if not self.embeddings or any(ids is None for ids in self.ids):
            return None
        ids = mx.concatenate(self.ids, axis=1)
        embeddings = mx.concatenate(self.embeddings, axis=1)
        hidden = None if self.layer == 0 else mx.concatenate(self.hidden, axis=1)
        mx.eval(ids, embeddings, *([] if hidden is None else [hidden]))
        return TapRecords(self.layer, ids, embeddings, hidden)

    def record_input(self, ids: mx.array | None, embeddings: mx.array, state=None) -> None:
        if state is not None and self.state is None:
            self.state = state
        self.ids.append(ids)
        self.embeddings.append(embeddings)
        if self.layer == 0:
            self.hidden.append(embeddings)

    def record_layer(self, number: int, hidden: mx.array) -> None:
        """``number``: transformers' index (the output of layer ``number - 1``)."""
        if number == self.layer:
            self.hidden.append(hidden)

    def positions(self) -> int:
        return sum(e.shape[1] for e in self.embeddings)

    def states(self, length: int) -> tuple[mx.array, mx.array]:
        """The first ``length`` positions' embeddings and tapped hidden states, each
        (length, width)."""
        if self.positions() < length:
            raise ValueError(f"the tap holds {self.positions()} positions, {length} asked for")
        embeddings = mx.concatenate(self.embeddings, axis=1)[0, :length]
        hidden = mx.concatenate(self.hidden, axis=1)[0, :length]
        return embeddings, hidden

    def embeddings_between(self, start: int, stop: int) -> mx.array:
        """The input embeddings of positions ``start`` to ``stop`` (stop - start, width),
        read from the passes that hold them only (a follower reading a few rows per step
        does not concatenate the whole record each time)."""
        return self._between(self.embeddings, start, stop)

    def hidden_between(self, start: int, stop: int) -> mx.array:
        """The tapped layer's states of positions ``start`` to ``stop``, likewise."""
        return self._between(self.hidden, start, stop)

    def _between(self, records: list[mx.array], start: int, stop: int) -> mx.array:
        if self.positions() < stop:
            raise ValueError(f"the tap holds {self.positions()} positions, {stop} asked for")
        parts, offset = [], 0
        for record in records:
            length = record.shape[1]
            if offset < stop and offset + length > start:
                parts.append(record[0, max(start - offset, 0):min(stop - offset, length)])
            offset += length
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)


class RowsTap:
    """A batched pass's tap: row ``i`` of each record handed to ``taps[i]`` (None: a row
    whose states nobody reads, e.g. a text-only request decoding beside spoken ones).
    Set as the decoder's ``hidden_tap`` for one batched decode step; each row's own tap
    then holds what it would have recorded decoding alone."""

    def __init__(self, taps: list[HiddenTap | None]):
        self.taps = taps

    def record_input(self, ids: mx.array | None, embeddings: mx.array, state=None) -> None:
        # the batch's position state is not a row's: each tap kept its own at its prefill
        for i, tap in enumerate(self.taps):
            if tap is not None:
                tap.record_input(None if ids is None else ids[i:i + 1], embeddings[i:i + 1])

    def record_layer(self, number: int, hidden: mx.array) -> None:
        for i, tap in enumerate(self.taps):
            if tap is not None:
                tap.record_layer(number, hidden[i:i + 1])
