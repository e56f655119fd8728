"""transformers' rotary embedding from a model's own cos/sin tables:
``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = [-x2, x1]`` of x's halves.

Shared by the Qwen decoders (M-RoPE) and the Qwen and Pixtral vision towers. On MLX's CPU
backend, with mlxvlm's kernels built, float32 inputs take ``mlxvlm.kernels.rotary``: one
operation where the composition below is seven (slices, negation, concatenation, two
products and a sum), which in a decoding step cost dispatch rather than arithmetic.
"""

from __future__ import annotations

import mlx.core as mx

from mlxvlm import kernels
from mlxvlm.models.layers import fast_math


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """``x * cos + rotate_half(x) * sin`` in x's dtype; cos and sin broadcast to x."""
    if (
        x.dtype == cos.dtype == sin.dtype == mx.float32
        and fast_math.use_fast_math(x)
        and kernels.enabled()
    ):
        return kernels.rotary(x, cos, sin)
    return (x * cos + rotate_half(x) * sin).astype(x.dtype)
