"""The KV caches of talkers stepped together (``SpeechBatch``), one row per talker, so
that a frame of every ready talker is one forward pass of the talker model.

Each row comes in with the KV cache of its talker's own prefill (a B=1 ``KVCache`` per
layer), right-aligned to the columns the batch has written so far (the rows already
there are padded on the left when the newcomer's prefill is longer). Every pass then
writes one column for every row; a row that was not fed in a pass (its talker waits for
the thinker's text, or ended) has that column masked out for itself, so its attention
only ever sees the columns it heard. Columns no row sees any more (those of rows that
left, and left padding) are dropped from the left and right as rows leave.

Why a mask rather than mlx-lm's ``BatchKVCache`` (left padding only, one write index for
all rows): a row waiting for text would need its fed column rolled into left padding
after every pass it sat out (a copy of the whole batch's cache), or the batch filtered
to the ready rows and merged back (the same copy); with a mask a waiting row costs
nothing but its share of the pass, which feeds it a ready row's input (so that an MoE
talker routes it to the same experts) and ignores its output.

Positions are the rows' own (each talker gives its next position), not the caches'.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

# columns added at a time when a pass needs more room (as mlx-lm's KVCache grows)
GROWTH = 256


class TalkerRows:
    """The batch's caches (``layers``: one per attention layer, the model's ``cache``
    argument) and which columns each row sees."""

    def __init__(self, layers: int):
        self.layers = [RowsLayerCache(self) for _ in range(layers)]
        self.visible = np.zeros((0, 0), bool)  # (rows, width): the columns each row heard
        self._fed: mx.array | None = None  # (rows,) the pass under way's fed rows

    def __len__(self) -> int:
        return self.visible.shape[0]

    @property
    def width(self) -> int:
        return self.visible.shape[1]

    def add(self, cache: Sequence) -> None:
        """A talker's prefilled cache (one mlx-lm ``KVCache`` per layer, B=1) as the last
        row; the talker's own cache may be dropped afterwards."""
        if len(cache) != len(self.layers):
            raise ValueError(f"a cache of {len(cache)} layers for a talker of {len(self.layers)}")
        length = cache[0].offset
        grow = max(0, length - self.width)
        width = self.width + grow
        visible = np.zeros((1, width), bool)
        visible[0, width - length:] = True
        self.visible = np.concatenate([np.pad(self.visible, ((0, 0), (grow, 0))), visible])
        for layer, row in zip(self.layers, cache):
            keys, values = row.keys[..., :length, :], row.values[..., :length, :]
            layer.add_row(keys, values, grow, width)

    def keep(self, indices: Sequence[int]) -> None:
        """Only the rows ``indices``, in that order; columns none of them sees dropped."""
        indices = list(indices)
        visible = self.visible[indices]
        seen = np.flatnonzero(visible.any(axis=0))
        first, last = (int(seen[0]), int(seen[-1]) + 1) if len(seen) else (0, 0)
        self.visible = visible[:, first:last]
        rows = mx.array(indices, dtype=mx.int32) if indices else None
        for layer in self.layers:
            layer.keep_rows(rows, first, last)

    def forward(self, call, inputs: mx.array, positions: mx.array, rows: Sequence[int]):
        """``call(inputs, positions, cache)`` (the talker model's pass) over the whole
        batch, ``inputs`` (n, 1, width) and ``positions`` (n, 3, 1) being those of the
        rows ``rows`` (distinct); their outputs, in that order. The other rows are fed the
        first one's input, which they do not hear."""
        source = np.zeros(len(self), np.int64)
        source[list(rows)] = np.arange(len(rows))
        fed = np.zeros(len(self), bool)
        fed[list(rows)] = True
        pick = mx.array(source)
        self._fed = mx.array(fed)
        try:
            out = call(inputs[pick], positions[pick], self.layers)
        finally:
            self._fed = None
        self.visible = np.concatenate([self.visible, fed[:, None]], axis=1)
        return out[mx.array(list(rows), dtype=mx.int32)]

    def mask(self) -> mx.array:
        """The pass's attention mask (rows, 1, 1, width + 1): each row sees the columns it
        heard and, if it is fed, the one being written."""
        if self._fed is None:
            raise RuntimeError("the talker rows are passed through TalkerRows.forward only")
        heard = mx.concatenate([mx.array(self.visible), self._fed[:, None]], axis=1)
        return heard[:, None, None, :]


class RowsLayerCache:
    """One attention layer's keys and values (rows, kv heads, columns, head dim), with
    room to grow; the column a pass writes is ``rows.width``."""

    def __init__(self, rows: TalkerRows):
        self.rows = rows
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def offset(self) -> int:
        return self.rows.width

    def add_row(self, keys: mx.array, values: mx.array, grow: int, width: int) -> None:
        """A row of ``keys``/``values`` (1, heads, length, dim) ending at column ``width``,
        the rows before it moved right by ``grow``."""
        if self.keys is None:
            self.keys, self.values = keys, values
            return
        self.keys, self.values = (_with_row(old[..., :width - grow, :], new, grow, width)
                                  for old, new in ((self.keys, keys), (self.values, values)))

    def keep_rows(self, rows: mx.array | None, first: int, last: int) -> None:
        if rows is None or self.keys is None:
            self.keys = self.values = None
            return
        self.keys = self.keys[rows, :, first:last]
        self.values = self.values[rows, :, first:last]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """mlx-lm's cache interface: the pass's column (rows, heads, 1, dim) written."""
        column = self.rows.width
        if self.keys is None or self.keys.shape[2] <= column:
            self.keys = _grown(self.keys, keys, column)
            self.values = _grown(self.values, values, column)
        self.keys[..., column:column + 1, :] = keys
        self.values[..., column:column + 1, :] = values
        return self.keys[..., :column + 1, :], self.values[..., :column + 1, :]

    def make_mask(self, N: int, *args, **kwargs) -> mx.array:
        if N != 1:
            raise ValueError("talker rows step one position at a time")
        return self.rows.mask()


def _with_row(old: mx.array, new: mx.array, grow: int, width: int) -> mx.array:
    """``old`` (its first ``width - grow`` columns) padded left by ``grow``, and ``new``
    padded left to ``width``, as one array."""
    old = mx.pad(old, [(0, 0), (0, 0), (grow, 0), (0, 0)]) if grow else old
    new = mx.pad(new, [(0, 0), (0, 0), (width - new.shape[2], 0), (0, 0)])
    return mx.concatenate([old, new.astype(old.dtype)], axis=0)


def _grown(buffer: mx.array | None, like: mx.array, used: int) -> mx.array:
    """``buffer``'s first ``used`` columns with room for ``GROWTH`` more after them."""
    rows, heads, _, dim = like.shape
    room = mx.zeros((rows, heads, GROWTH, dim), like.dtype)
    if buffer is None:
        return room
    return mx.concatenate([buffer[..., :used, :], room], axis=2)
