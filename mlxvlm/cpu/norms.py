"""LayerNorm and RMSNorm layers that use mlxvlm's CPU kernel.

MLX's CPU ``layer_norm`` is slow over a vision tower's activations, and ``kernels.norm``
is vectorised and threaded. In a decoding step the work is a few hundred floats and the
cost is dispatch: MLX's CPU backend composes ``mx.fast.rms_norm`` from ~12 operations
(square, sum, rsqrt, products and their broadcasts), the kernel is one. The layers
below are ``nn.LayerNorm`` / ``nn.RMSNorm`` subclasses with the same parameters (and a
module for Gemma's ``1 + weight`` RMSNorm); other dtypes keep MLX's ``mx.fast``
functions, and the kernel's derivatives are theirs.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxvlm.cpu import kernels, policy


def _kernel_applies(x: mx.array) -> bool:
    return policy.fast_math_applies(x) and kernels.enabled()


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
        return kernels.norm(x, self.get("weight"), self.get("bias"), eps=self.eps)


class CPURMSNorm(nn.RMSNorm):
    def __init__(self, layer: nn.RMSNorm):
        nn.Module.__init__(self)
        self.eps = layer.eps
        self.weight = layer.weight

    def __call__(self, x: mx.array) -> mx.array:
        if not _kernel_applies(x) or self.weight.dtype != mx.float32:
            return super().__call__(x)
        return kernels.norm(x, self.weight, None, eps=self.eps, rms=True)


# Gemma's RMSNorm (mlx-lm's gemma, gemma2, gemma3_text): scales by (1 + weight).
_GEMMA_RMS_NORMS = tuple(
    importlib.import_module(f"mlx_lm.models.{name}").RMSNorm
    for name in ("gemma", "gemma2", "gemma3_text")
)


class CPUGemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm, ``mx.fast.rms_norm(x, 1 + weight, eps)``, on the kernel."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.eps = layer.eps
        self.weight = layer.weight

    def __call__(self, x: mx.array) -> mx.array:
        if not _kernel_applies(x) or self.weight.dtype != mx.float32:
            return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)
        return kernels.norm(x, self.weight, None, eps=self.eps, rms=True, weight_offset=1.0)


def use_cpu_norms(model: nn.Module) -> int:
    """Swap the model's LayerNorm/RMSNorm layers for the ones above, in place; returns how
    many were swapped."""
    replacements = []
    for name, m in model.named_modules():
        if type(m) is nn.LayerNorm:
            replacements.append((name, CPULayerNorm(m)))
        elif type(m) is nn.RMSNorm:
            replacements.append((name, CPURMSNorm(m)))
        elif type(m) in _GEMMA_RMS_NORMS:
            replacements.append((name, CPUGemmaRMSNorm(m)))
    if replacements:
        model.update_modules(tree_unflatten(replacements))
    return len(replacements)
