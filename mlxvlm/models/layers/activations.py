"""Activation functions by their transformers names (``ACT2FN`` keys), shared by the
vision towers, projectors and blocks that read ``hidden_act`` from a config.

Each entry computes the same function as transformers' class of that name, so that a
port matches the reference to float rounding:

- ``gelu``: the exact erf form (``GELUActivation``) -> ``nn.gelu``.
- ``gelu_pytorch_tanh``: the tanh approximation (``GELUTanh``) -> ``nn.gelu_approx``.
- ``quick_gelu``: ``x * sigmoid(1.702 x)`` (``QuickGELUActivation``) ->
  ``nn.gelu_fast_approx``, which is exactly that in the MLX this project requires
  (tests/test_activations.py checks every entry against transformers).
- ``silu`` and ``swish`` (its other name): ``x * sigmoid(x)`` -> ``nn.silu``.
- ``relu`` -> ``nn.relu``.

The last three go through ``mlxvlm.cpu.ops`` (same function, faster on the CPU backend).

Names not listed (``gelu_new``, whose float32 form differs from ``nn.gelu_approx`` by up
to 1.7e-4, ``gelu_fast``, ``gelu_10``, ...) are refused rather than approximated.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.cpu.ops import gelu_tanh, quick_gelu, silu

# The exponential-based ones run through the CPU backend's door, which computes the same function
# faster on MLX's CPU backend and is exactly MLX's function everywhere else.
ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "gelu": nn.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "quick_gelu": quick_gelu,
    "silu": silu,
    "swish": silu,
    "relu": nn.relu,
}


def activation(name: str) -> Callable[[mx.array], mx.array]:
    """The MLX function for transformers' activation ``name``; NotImplementedError (naming
    the supported ones) for any other."""
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"activation {name!r} is not supported (supported: {sorted(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]
