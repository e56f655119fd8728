"""Cross-attention to a sequence's source (an image's encoded states): the layer cache
that holds the source's keys and values, and the state that says which part of the
source each text token reads.

A decoder with cross-attention layers (Llama 3.2 Vision) projects the source into keys
and values once per sequence and reads them at every later step. ``CrossAttentionCache``
is that layer's entry in the sequence's cache list, beside the self-attention layers' KV
caches, and follows mlx-lm's cache protocol so that the shared machinery carries it
unchanged:

- it counts no tokens (it has no ``offset``: ``state_cache.cache_offset`` reads the
  sequence's length elsewhere), and ``trim`` leaves it as it is: the source's keys do
  not depend on how many tokens follow, so a prompt-cache entry cut to a shared prefix
  keeps them (the prefix cache keys prompts so that a prefix is shared only with the
  same source, see ``VisionLanguageModel.media_condition_every_token``);
- ``max_kv_size`` and ``kv_bits`` leave it alone (it is not an mlx-lm ``KVCache``);
- the batching engine merges rows of it as it merges KV caches (``merge`` / ``extend`` /
  ``filter`` / ``extract``): each row's keys padded at the end to the longest row's,
  its own length in ``lengths``.

A cache is filled for one source: ``fill`` records the source's id (``CrossAttentionState
.source_id``), and a state carrying another source's states (a new prompt's image)
fills it again, so a reused cache never lends one prompt's image to another.

``CrossAttentionState`` is a prompt's per-request state for such a decoder: the source's
states (until the cache holds their keys), and per prompt position which blocks of the
source (an image's tiles) that token attends to; tokens past the prompt read as its last
token does (transformers' generation repeats the mask's last row).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Sequence

import mlx.core as mx
import numpy as np

_source_ids = itertools.count(1)


def new_source_id() -> int:
    """An id for a freshly encoded source (never reused in the process)."""
    return next(_source_ids)


def _pad_to(x: mx.array, length: int) -> mx.array:
    missing = length - x.shape[2]
    return x if missing == 0 else mx.pad(x, [(0, 0), (0, 0), (0, missing), (0, 0)])


class CrossAttentionCache:
    """One cross-attention layer's keys and values of its rows' sources,
    (rows, kv_heads, source length, head_dim); empty until ``fill``."""

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths: list[int] | None = None  # per row (batched); None: one row, all of it
        self.source_id: int | None = None  # the source it was filled for (one row)
        self.rows = 1

    def holds(self, source_id: int | None) -> bool:
        """Whether it holds keys for ``source_id`` (None: for whatever source it has)."""
        return self.keys is not None and (source_id is None or source_id == self.source_id)

    def fill(self, keys: mx.array, values: mx.array, source_id: int | None) -> None:
        self.keys, self.values, self.source_id = keys, values, source_id
        self.lengths, self.rows = None, keys.shape[0]

    def row_lengths(self) -> list[int]:
        if self.keys is None:
            return [0] * self.rows
        return list(self.lengths) if self.lengths is not None else [self.keys.shape[2]] * self.rows

    # -- mlx-lm's cache protocol --------------------------------------------------------

    @property
    def state(self):
        return [] if self.keys is None else [self.keys, self.values]

    @state.setter
    def state(self, v):
        self.keys, self.values = (v or (None, None))

    @classmethod
    def from_state(cls, state) -> "CrossAttentionCache":
        """One row holding ``state``'s keys (a prompt cache read back from disk)."""
        cache = cls()
        if state:
            cache.fill(*state, None)
        return cache

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return 0  # it holds no tokens

    def size(self) -> int:
        return 0

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def __deepcopy__(self, memo) -> "CrossAttentionCache":
        # Arrays are never written in place: a copy shares them.
        copy = CrossAttentionCache()
        copy.__dict__.update(self.__dict__)
        copy.lengths = None if self.lengths is None else list(self.lengths)
        return copy

    # -- batching ----------------------------------------------------------------------

    @classmethod
    def merge(cls, caches: Sequence["CrossAttentionCache"]) -> "CrossAttentionCache":
        merged = cls()
        merged.rows = 0
        for cache in caches:
            merged.extend(cache)
        return merged

    def extend(self, other: "CrossAttentionCache") -> None:
        lengths = self.row_lengths() + other.row_lengths()
        filled = [c for c in (self, other) if c.keys is not None]
        if filled:
            longest = max(lengths)
            sample = filled[0].keys

            def part(cache: CrossAttentionCache, name: str) -> mx.array:
                x = getattr(cache, name)
                if x is None:
                    return mx.zeros((cache.rows, sample.shape[1], longest, sample.shape[3]),
                                    sample.dtype)
                return _pad_to(x, longest)

            parts = [c for c in (self, other) if c.rows]
            self.keys = mx.concatenate([part(c, "keys") for c in parts])
            self.values = mx.concatenate([part(c, "values") for c in parts])
        self.rows += other.rows
        self.lengths = lengths
        self.source_id = None

    def filter(self, batch_indices: Sequence[int]) -> None:
        lengths = self.row_lengths()
        indices = list(batch_indices)
        self.rows = len(indices)
        self.lengths = [lengths[i] for i in indices]
        if self.keys is not None:
            select = mx.array(indices)
            self.keys, self.values = self.keys[select], self.values[select]

    def extract(self, idx: int) -> "CrossAttentionCache":
        cache = CrossAttentionCache()
        length = self.row_lengths()[idx]
        if self.keys is not None and length:
            cache.fill(self.keys[idx : idx + 1, :, :length], self.values[idx : idx + 1, :, :length],
                       None)
        return cache


@dataclass
class CrossAttentionState:
    """A prompt's cross-attention inputs (batched: one row per sequence).

    ``block_mask``: (rows, positions, blocks) -- whether the token at each prompt position
    attends to each block of its source (the source is ``blocks x block_size`` states,
    e.g. images x tiles x patches); ``blocks``: each row's own blocks (0: no source, the
    cross-attention layers leave that row as it is); ``source``: the states to project
    keys from (None once the cache holds them); ``source_positions``: where the prompt
    names its source (image tokens), which a shared prefix must hold all of or none."""

    block_mask: np.ndarray
    blocks: list[int]
    block_size: int
    source: mx.array | None = None
    source_id: int | None = None
    source_positions: tuple[int, ...] = ()

    def rows_at(self, start: int, length: int) -> np.ndarray:
        """(rows, length, blocks): the block mask of positions ``start`` on; positions past
        the prompt read its last one."""
        last = self.block_mask.shape[1] - 1
        positions = np.minimum(np.arange(start, start + length), last)
        return self.block_mask[:, positions]

    def attention_inputs(self, start: int, length: int, key_length: int):
        """For ``length`` tokens from position ``start`` against keys of ``key_length``
        (a batched cache's rows padded to the longest): ``(mask, reads, present)``.

        ``mask`` (rows, 1, length, key_length) bool: the keys each token attends to. A
        token that attends to no block (text before the image) attends to all of its
        row's own source instead, as transformers' mask does once it zeroes such rows;
        ``reads`` (rows, length, 1): 1.0 where a token attends to some block (transformers'
        ``full_text_row_masked_out_mask``, which silences those tokens' MLP); ``present``
        (rows, 1, 1) bool: rows with a source at all (None: every row has one)."""
        rows = self.rows_at(start, length)  # (B, L, N)
        allowed = np.repeat(rows, self.block_size, axis=2)
        own = np.arange(key_length)[None, :] < (np.asarray(self.blocks)[:, None] * self.block_size)
        padded = np.zeros(allowed.shape[:2] + (key_length,), dtype=bool)
        width = min(allowed.shape[2], key_length)
        padded[:, :, :width] = allowed[:, :, :width]
        padded &= own[:, None, :]
        reads = padded.any(axis=2, keepdims=True)
        # No block at all: the row's whole source; no source: anything finite (unused).
        fallback = np.where(own.any(axis=1)[:, None], own, True)[:, None, :]
        mask = np.where(reads, padded, fallback)
        present = np.asarray(self.blocks)[:, None, None] > 0
        return (mx.array(mask)[:, None], mx.array(reads.astype(np.float32)),
                None if present.all() else mx.array(present))

    @staticmethod
    def batch(states: Sequence["CrossAttentionState | None"]) -> "CrossAttentionState | None":
        """Rows for decoding (their prompts' last positions); a row without a source
        (None: a text-only prompt) has no blocks."""
        present = [s for s in states if s is not None]
        if not present:
            return None
        block_size = present[0].block_size
        width = max(s.block_mask.shape[2] for s in present)
        mask = np.zeros((len(states), 1, width), dtype=bool)
        blocks = []
        for row, state in enumerate(states):
            if state is None:
                blocks.append(0)
                continue
            last = state.block_mask[0, -1]
            mask[row, 0, : last.shape[0]] = last
            blocks.append(state.blocks[0])
        return CrossAttentionState(mask, blocks, block_size)

    def stored(self) -> "CrossAttentionState":
        """Without the source's states: a cache that keeps this state holds their keys."""
        return replace(self, source=None)

    def prefix(self, length: int) -> "CrossAttentionState | None":
        """The state of a prompt that shares the first ``length`` tokens and goes on with
        text only: its source is the cached one (``source`` dropped), or none when the
        prefix names none. A prefix that names part of the source cannot be reused."""
        named = [p for p in self.source_positions if p < length]
        if not named:
            return None
        if len(named) < len(self.source_positions):
            raise NotImplementedError("a prefix that holds only some of the prompt's images")
        return replace(self, block_mask=self.block_mask[:, :length], source=None)
