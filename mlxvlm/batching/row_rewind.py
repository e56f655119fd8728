"""Taking each row's rejected tokens back out of a batch's caches after one speculative
pass, every row having kept a count of its own.

The pass feeds every row its tokens right-padded to the longest row's (a row's real
tokens come first, so causal attention keeps its pads out of them; recurrent layers are
told each row's length, mlx-lm's ``ArraysCache.lengths``, and hold their state over the
pads). After the verdicts:

- attention layers (mlx-lm's ``BatchKVCache``, one write index for all rows) are trimmed
  to the most any row kept, and each row that kept fewer is rolled right by the
  difference, which becomes left padding (mlx-lm's own ``prepare(right_padding)`` /
  ``finalize``, as its batched prefill realigns right-padded prompts). A row's positions
  follow its own offset, so nothing else moves;
- a recurrent or convolution state cannot drop tokens: a row that kept its whole feed
  keeps the state the pass left, any other goes back to its state before the pass
  (and its attention rows hold none of the pass), and feeds the tokens it kept again at
  the start of its next pass, as single-sequence speculation does (``generate.rewind``).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxvlm.generate.state_cache import is_state_cache


def rewindable(cache: Sequence[Any]) -> bool:
    """Whether a sequence's cache, as a batch row, can be taken back row by row here:
    whole KV caches and recurrent states (not a rotating window, a quantized cache, a
    family's own kind)."""
    return all(type(c) is KVCache or is_state_cache(c) for c in cache)


class BatchCheckpoint:
    """A batch's caches as they were before a pass that feeds row ``i`` ``lengths[i]``
    real tokens (the rest of the pass's width being pads)."""

    def __init__(self, cache: list[Any], lengths: list[int]):
        self.lengths = lengths
        self.width = max(lengths)
        self.states = {i: list(c.cache) for i, c in enumerate(cache) if is_state_cache(c)}
        if self.states and min(lengths) < self.width:
            for i in self.states:
                cache[i].prepare(lengths=lengths)

    def rewind(self, cache: list[Any], keep: list[int]) -> list[int]:
        """Leave row ``i`` holding the first ``keep[i]`` of its fed tokens, or, where a
        recurrent state cannot give the rest back, none of them; what each row holds."""
        held = list(keep)
        if self.states:
            held = [k if k == n else 0 for k, n in zip(keep, self.lengths)]
            whole = mx.array([h > 0 for h in held])
            for i, saved in self.states.items():
                layer = cache[i]
                layer.cache = [_rows_where(whole, now, before)
                               for now, before in zip(layer.cache, saved)]
                layer.lengths = None
        most = max(held)
        shift = [most - h for h in held]
        attention = [layer for layer in cache if isinstance(layer, BatchKVCache)]
        common = 0
        if attention and any(shift):
            # Every attention layer holds the same padding: read once, not per layer.
            padding = attention[0].left_padding.tolist()
            common = min(p + s for p, s in zip(padding, shift))
        for layer in attention:
            layer.trim(self.width - most)
            if any(shift):
                layer.prepare(right_padding=shift)
                layer.finalize()
                _drop_padding(layer, common)
        return held


def _rows_where(rows: mx.array, now: mx.array | None, before: mx.array | None) -> mx.array | None:
    if now is None or before is None:
        return now
    return mx.where(rows.reshape(-1, *([1] * (now.ndim - 1))), now, before)


def _drop_padding(layer: BatchKVCache, common: int) -> None:
    """Left padding every row has (``common``) is sliced off (a view, no copy), so that a
    batch whose rows keep taking turns at accepting most does not grow its width without
    bound."""
    if common > 0:
        layer.keys = layer.keys[..., common:, :]
        layer.values = layer.values[..., common:, :]
        layer._idx -= common
        layer.left_padding = layer.left_padding - common
