"""mlx-lm's text models on the CPU backend's fast paths, rewritten in place at load.

mlx-lm's gated MLPs become ``GatedMLP`` over the same projections, with ``fast_math``'s
activation, and the attention calls of mlx-lm's model files are routed through
``attention.cached_attention``. Both compute what mlx-lm computes; ``fast_paths`` calls
them only on the CPU backend.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models import base as mlx_lm_base

from mlxvlm.cpu import attention, fast_math


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` over an mlx-lm MLP's own three projections (same
    parameter names), with ``fast_math``'s activation: what mlx-lm's llama/mistral/qwen2
    (SiLU) and gemma3_text (GELU, tanh form) MLPs compute, faster on the CPU backend."""

    def __init__(self, mlp: nn.Module, act):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._gated = fast_math.gated(act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self._gated(self.gate_proj(x), self.up_proj(x)))


# mlx-lm module -> the activation of its ``MLP`` class (read from its source: the class
# computes down(act(gate(x)) * up(x)) with exactly these three children).
_GATED_MLP_ACTIVATIONS = {
    "mlx_lm.models.llama": fast_math.silu,
    "mlx_lm.models.qwen2": fast_math.silu,
    "mlx_lm.models.gemma3_text": fast_math.gelu_tanh,
}


def use_fast_mlps(model: nn.Module) -> int:
    """Replace mlx-lm MLPs of the known kinds inside ``model`` by ``GatedMLP`` (same
    parameters); returns how many were replaced."""
    replacements = []
    for name, module in model.named_modules():
        cls = type(module)
        act = _GATED_MLP_ACTIVATIONS.get(cls.__module__)
        if cls.__name__ == "MLP" and act is not None:
            replacements.append((name, GatedMLP(module, act)))
    if replacements:
        model.update_modules(tree_unflatten(replacements))
    return len(replacements)


def use_fast_attention(model: nn.Module) -> list[str]:
    """Point the mlx-lm model files that ``model`` uses at ``attention.cached_attention``.

    mlx-lm's attention classes call the ``scaled_dot_product_attention`` their module
    imported from ``mlx_lm.models.base``; that name is the one hook they offer, so it is
    rebound in those modules (the function computes the same attention on every backend,
    and is MLX's own kernel wherever ``attention`` does not take its CPU path). Returns
    the modules rebound."""
    rebound = []
    for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
        module = sys.modules.get(name)
        if not name.startswith("mlx_lm.models.") or module is None:
            continue
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is mlx_lm_base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = attention.cached_attention
        if getattr(module, "scaled_dot_product_attention", None) is attention.cached_attention:
            rebound.append(name)
    return rebound
