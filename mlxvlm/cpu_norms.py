"""LayerNorm and RMSNorm layers that use mlxvlm's CPU kernel.

MLX's CPU ``layer_norm`` takes ~5 ms for one SigLIP layer's 1024 x 768 activations on a
2-core x86-64 machine, twice per layer; ``mlxvlm.kernels.norm`` does it in well under a
millisecond. In a decoding step the work is a few hundred floats and the cost is
dispatch: MLX's CPU backend composes ``mx.fast.rms_norm`` from ~12 operations (square,
sum, rsqrt, products and their broadcasts) at ~10 us each, the kernel is one. The layers
below are ``nn.LayerNorm`` / ``nn.RMSNorm`` subclasses with the same parameters; other
dtypes and the backward pass keep MLX's ``mx.fast`` functions
(``fast_math.with_reference_vjp``).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxvlm import kernels
from mlxvlm.models.layers import fast_math


def _kernel_applies(x: mx.array) -> bool:
    return fast_math.use_fast_math(x) and kernels.enabled()


@functools.lru_cache(maxsize=None)
def _layer_norm(eps: float, has_weight: bool, has_bias: bool):
    """The kernel's LayerNorm with MLX's VJP, as a function of (x, [weight], [bias]); one
    per (eps, affine) combination, built once."""

    def split(params):
        params = list(params)
        weight = params.pop(0) if has_weight else None
        return weight, params.pop(0) if has_bias else None

    return fast_math.with_reference_vjp(
        lambda x, *params: kernels.norm(x, *split(params), eps=eps),
        lambda x, *params: mx.fast.layer_norm(x, *split(params), eps),
    )


@functools.lru_cache(maxsize=None)
def _rms_norm(eps: float):
    return fast_math.with_reference_vjp(
        lambda x, weight: kernels.norm(x, weight, None, eps=eps, rms=True),
        lambda x, weight: mx.fast.rms_norm(x, weight, eps),
    )


class CPULayerNorm(nn.LayerNorm):
    def __init__(self, layer: nn.LayerNorm):
        nn.Module.__init__(self)
        self.eps = layer.eps
        self.dims = layer.dims
        for name in ("weight", "bias"):
            if name in layer:
                setattr(self, name, layer[name])

    def __call__(self, x: mx.array) -> mx.array:
        params = [p for p in (self.get("weight"), self.get("bias")) if p is not None]
        if not _kernel_applies(x) or any(p.dtype != mx.float32 for p in params):
            return super().__call__(x)
        return _layer_norm(self.eps, "weight" in self, "bias" in self)(x, *params)


class CPURMSNorm(nn.RMSNorm):
    def __init__(self, layer: nn.RMSNorm):
        nn.Module.__init__(self)
        self.eps = layer.eps
        self.weight = layer.weight

    def __call__(self, x: mx.array) -> mx.array:
        if not _kernel_applies(x) or self.weight.dtype != mx.float32:
            return super().__call__(x)
        return _rms_norm(self.eps)(x, self.weight)


def use_cpu_norms(model: nn.Module) -> int:
    """Swap the model's LayerNorm/RMSNorm layers for the ones above, in place; returns how
    many were swapped."""
    replacements = []
    for name, m in model.named_modules():
        if type(m) is nn.LayerNorm:
            replacements.append((name, CPULayerNorm(m)))
        elif type(m) is nn.RMSNorm:
            replacements.append((name, CPURMSNorm(m)))
    if replacements:
        model.update_modules(tree_unflatten(replacements))
    return len(replacements)
