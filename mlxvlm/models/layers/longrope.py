"""LongRoPE (Phi-3.5 / Phi-4's ``rope_type: longrope``) as transformers applies it.

The rotated part of each head (``partial_rotary_factor`` of it) turns at frequencies
divided by per-frequency factors: the *short* factors while the sequence -- the last
position of the pass, plus one -- is within ``original_max_position_embeddings``, the
*long* ones past it; cos and sin are scaled by the attention factor
(``sqrt(1 + ln(factor) / ln(original))`` unless the config gives one). mlx-lm's
``SuScaledRoPE`` always takes the long factors, which differ from transformers' for
every sequence a model was trained at; this module takes transformers' rule, per pass
(and per row of a batch, by its own offset).

transformers runs a whole prompt in one pass, so a prompt longer than the original
length is on the long factors from its first token; mlxvlm prefills in chunks, whose
first ones would end within it. A family therefore marks such sequences (``long_rows``,
one flag per row of the pass, from the prompt's length) and this rotary takes the long
factors for them at every position. A sequence that grows past the original length
later (during an answer, or in a later turn of a cached conversation) keeps the keys it
cached with the short factors; transformers instead recomputes the whole sequence once
with the long ones at that point (its ``prepare_inputs_for_generation``).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# The rows of the pass being built on this thread that are on the long factors throughout
# (None: none is). Per thread: two threads may run one model.
_LONG_ROWS = threading.local()


@contextlib.contextmanager
def long_rows(rows: np.ndarray | None) -> Iterator[None]:
    """Within it, the rotaries built on this thread take the long factors for the rows
    of the pass where ``rows`` (a (B,) bool array) is true, at every position."""
    previous = getattr(_LONG_ROWS, "rows", None)
    _LONG_ROWS.rows = None if rows is None or not np.any(rows) else np.asarray(rows, dtype=bool)
    try:
        yield
    finally:
        _LONG_ROWS.rows = previous


def attention_factor(params: dict, max_position_embeddings: int) -> float:
    """transformers' ``_compute_longrope_parameters`` scaling of cos and sin."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class LongRoPE(nn.Module):
    def __init__(self, dims: int, base: float, short_factor: Sequence[float],
                 long_factor: Sequence[float], original_max_position_embeddings: int,
                 scale: float):
        super().__init__()
        if len(short_factor) != dims // 2 or len(long_factor) != dims // 2:
            raise ValueError(f"longrope factors must have {dims // 2} values (rotary dims {dims})")
        self.dims = dims
        self.original = original_max_position_embeddings
        self.scale = scale
        wavelengths = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        # Kept out of the parameter tree (underscored): computed, never loaded.
        self._short = mx.array(short_factor, dtype=mx.float32) * wavelengths
        self._long = mx.array(long_factor, dtype=mx.float32) * wavelengths

    def _rotate(self, x: mx.array, offset, freqs: mx.array) -> mx.array:
        return mx.fast.rope(x.at[..., : self.dims].multiply(self.scale), self.dims,
                            traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        """``x``: (B, heads, L, head_dim) at positions ``offset ..``; ``offset`` an int or
        one per row (a batched cache)."""
        length = x.shape[-2]
        pinned = getattr(_LONG_ROWS, "rows", None)
        if isinstance(offset, int) and (pinned is None or pinned.all()):
            long = offset + length > self.original or pinned is not None
            return self._rotate(x, offset, self._long if long else self._short)
        long = offset + length > self.original
        if pinned is not None:
            long = mx.logical_or(mx.array(pinned), long)
        long = mx.broadcast_to(long, (x.shape[0],)).reshape(-1, 1, 1, 1)
        return mx.where(long, self._rotate(x, offset, self._long), self._rotate(x, offset, self._short))
