"""LongRoPE (Phi-3.5 / Phi-4's ``rope_type: longrope``) as transformers applies it.

The rotated part of each head (``partial_rotary_factor`` of it) turns at frequencies
divided by per-frequency factors: the *short* factors while the sequence -- the last
position of the pass, plus one -- is within ``original_max_position_embeddings``, the
*long* ones past it; cos and sin are scaled by the attention factor
(``sqrt(1 + ln(factor) / ln(original))`` unless the config gives one). mlx-lm's
``SuScaledRoPE`` always takes the long factors, which differ from transformers' for
every sequence a model was trained at; this module takes transformers' rule, decided per
pass (and per row of a batch, by its own offset).

A sequence that grows past the original length during one generation keeps the keys it
cached with the short factors; transformers instead recomputes the whole sequence once
with the long ones at that point (its ``prepare_inputs_for_generation``).
"""

from __future__ import annotations

import math
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn


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
        if isinstance(offset, int):
            return self._rotate(x, offset, self._long if offset + length > self.original else self._short)
        long = (offset + length > self.original).reshape(-1, 1, 1, 1)
        return mx.where(long, self._rotate(x, offset, self._long), self._rotate(x, offset, self._short))
