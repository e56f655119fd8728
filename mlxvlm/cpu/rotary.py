"""The CPU backend's side of transformers' rotary embedding from cos/sin tables
(``models/layers/rotary.py``): with mlxvlm's kernels built, float32 inputs take
``kernels.rotary``, one operation where the composition is seven (slices, negation,
concatenation, two products and a sum), which in a decoding step cost dispatch rather
than arithmetic."""

from __future__ import annotations

import mlx.core as mx

from mlxvlm.cpu import kernels, policy


def takes_kernel(x: mx.array, cos: mx.array, sin: mx.array) -> bool:
    return (
        x.dtype == cos.dtype == sin.dtype == mx.float32
        and policy.fast_math_applies(x)
        and kernels.enabled()
    )


def rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    # Looked up on the module at each call (tests count the kernel's calls).
    return kernels.rotary(x, cos, sin)
