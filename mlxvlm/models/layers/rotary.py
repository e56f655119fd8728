"""transformers' rotary embedding from a model's own cos/sin tables:
``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = [-x2, x1]`` of x's halves.

Shared by the Qwen decoders (M-RoPE) and the Qwen and Pixtral vision towers. On MLX's CPU
backend, with mlxvlm's kernels built, float32 inputs take one kernel call instead of the
composition below (``mlxvlm.cpu.rotary``, through ``mlxvlm.cpu.ops``).
"""

from __future__ import annotations

import mlx.core as mx

from mlxvlm.cpu.ops import rotary, rotary_takes_kernel


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """``x * cos + rotate_half(x) * sin`` in x's dtype; cos and sin broadcast to x."""
    if rotary_takes_kernel(x, cos, sin):
        return rotary(x, cos, sin)
    return (x * cos + rotate_half(x) * sin).astype(x.dtype)
