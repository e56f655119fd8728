"""Scaled dot-product attention: ``mx.fast.scaled_dot_product_attention``, with a faster
path for float32 attention on MLX's CPU backend.

On the CPU, MLX evaluates ``mx.fast.scaled_dot_product_attention`` as a score matmul, a
softmax and a value matmul, and the softmax dominates (see ``fast_math``). Where
mlxvlm's CPU kernels are built (``kernels.attention``) the attention is one C++
primitive at every size. Without them, large problems take the MLX composition here,
which

- takes the queries in blocks, so that each block's scores stay in cache while they are
  exponentiated;
- uses ``fast_math``'s exponential and gets each row's sum from the value matmul itself
  (the values carry an extra column of ones), normalising the small output rather than
  the large probability matrix;
- runs on the caller's stream (alternating the blocks over two CPU streams made the
  two streams' BLAS threads fight for the cores).

The maths is the reference softmax(q k^T * scale + mask) v with the row maximum
subtracted; results agree with MLX's to float32 rounding (tests/test_fast_math.py).
Every other backend or dtype takes MLX's kernel, and the derivatives are those of MLX's
attention (``fast_math.with_reference_vjp`` here, the kernel's own in C++).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base as mlx_lm_base

from mlxvlm.cpu import fast_math, kernels, policy

# Without mlxvlm's kernels, below this many scores (batch x heads x queries x keys) MLX's
# own attention is as fast as the blocked composition. The kernel takes every size: a
# decoding step's attention is one operation there, against ~8 in MLX's composition.
MIN_SCORES = 1 << 15
# Scores per query block (3 MB of float32): 48-64 query rows for 12-16 heads over 1024
# keys, measured fastest among 32-96 rows on a 2-core x86-64 machine; larger blocks keep
# BLAS efficient, smaller ones keep the exponentials in cache.
BLOCK_SCORES = 3 << 18


def _query_block_mask(mask, start: int, stop: int, queries: int, keys: int, dtype):
    """The additive or boolean mask for queries ``start:stop``; ``None`` for no mask."""
    if mask is None:
        return None
    if isinstance(mask, str):  # "causal": query i sees keys up to i + (keys - queries)
        rows = mx.arange(start, stop)[:, None] + (keys - queries)
        return rows >= mx.arange(keys)[None]
    if mask.ndim >= 2 and mask.shape[-2] != 1:
        return mask[..., start:stop, :]
    return mask


def _apply_mask(scores: mx.array, mask) -> mx.array:
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        # The most negative finite float, not -inf: a row with no visible key then gets
        # uniform weights instead of NaN.
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask.astype(scores.dtype)


def _blocked_attention(q, k, v, scale: float, mask) -> mx.array:
    B, heads, queries, dims = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    repeats = heads // kv_heads
    q = q * scale
    if repeats > 1:  # grouped-query attention: each kv head serves `repeats` query heads
        q = q.reshape(B, kv_heads, repeats, queries, dims)
        k, v = k[:, :, None], v[:, :, None]
        if isinstance(mask, mx.array) and mask.ndim == 4:
            mask = mask.reshape(mask.shape[0], -1, 1, *mask.shape[2:])
            if mask.shape[1] == heads:
                mask = mask.reshape(B, kv_heads, repeats, *mask.shape[3:])
    keys_t = mx.contiguous(k).swapaxes(-1, -2)  # one copy, not one per block
    values_and_ones = mx.concatenate([v, mx.ones((*v.shape[:-1], 1), v.dtype)], axis=-1)
    block = max(1, BLOCK_SCORES // (B * heads * keys))
    outputs = []
    for start in range(0, queries, block):
        stop = min(start + block, queries)
        scores = q[..., start:stop, :] @ keys_t
        scores = _apply_mask(
            scores, _query_block_mask(mask, start, stop, queries, keys, scores.dtype)
        )
        weights = fast_math.exp_kernel(scores - fast_math.max_last_axis(scores))
        out = weights @ values_and_ones
        outputs.append(out[..., :dims] / out[..., dims:])
    out = mx.concatenate(outputs, axis=-2) if len(outputs) > 1 else outputs[0]
    return out.reshape(B, heads, queries, dims)


def scaled_dot_product_attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)``: q of
    shape (B, heads, queries, dims), k and v (B, kv_heads, keys, dims); ``mask`` None,
    ``"causal"``, or a boolean (True = attend) or additive array broadcastable to
    (B, heads, queries, keys)."""
    B, heads, queries, _ = q.shape
    keys = k.shape[2]
    use_kernel = kernels.enabled()
    if (
        not policy.fast_math_applies(q)
        or k.dtype != mx.float32
        or v.dtype != mx.float32
        or (not use_kernel and B * heads * queries * keys < MIN_SCORES)
    ):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    if use_kernel:  # one operation; its derivatives are MLX's attention's
        return kernels.attention(q, k, v, scale=scale, mask=mask)

    def reference(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def forward(q, k, v):
        return _blocked_attention(q, k, v, scale, mask)

    return fast_math.with_reference_vjp(forward, reference)(q, k, v)


def cached_attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """Attention with mlx-lm's ``scaled_dot_product_attention`` signature (models/base.py):
    a quantized KV cache (``--kv-bits``) or attention sinks go to mlx-lm's function, the
    rest to ``scaled_dot_product_attention`` above. Text decoders call this one."""
    if sinks is not None or hasattr(cache, "bits"):
        return mlx_lm_base.scaled_dot_product_attention(
            queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
        )
    return scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
