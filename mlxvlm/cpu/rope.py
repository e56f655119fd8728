"""Rotary embeddings on mlxvlm's CPU kernel.

MLX's CPU backend computes ``mx.fast.rope`` as a composition of ~20 operations
(positions, frequencies, cos, sin, the half products, a concatenation and the broadcasts
between them). A decoding step applies it twice per layer to a few hundred floats, so
its cost is dispatch, a large share of a small model's decoding step.
``kernels.rope`` computes the same rotation as one operation.

The modules below replace mlx-lm's and MLX's rotary modules whose call is
``mx.fast.rope`` with their own settings (``nn.RoPE``: base and scale; mlx-lm's
``Llama3RoPE`` and ``ProportionalRoPE``: frequencies). They keep the replaced module and
call it for anything but float32 input on the CPU with the kernels built. Rotary modules
that scale their input first (YaRN, LongRoPE) or compute a base per call (dynamic NTK)
stay as they are.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models import rope_utils

from mlxvlm.cpu import kernels, policy

# mlx-lm's rotary modules whose __call__ is mx.fast.rope(x, self.dims, traditional=
# self.traditional, base=None, scale=1.0, offset=offset, freqs=self._freqs).
_FREQUENCY_MODULES = tuple(
    getattr(rope_utils, name) for name in ("Llama3RoPE", "ProportionalRoPE")
    if hasattr(rope_utils, name)
)


def _kernel_applies(x: mx.array) -> bool:
    return policy.fast_math_applies(x) and x.ndim >= 3 and kernels.enabled()


class CPURoPE(nn.Module):
    """``replaced`` (a rotary module computing ``mx.fast.rope``), on the CPU kernel."""

    def __init__(self, replaced: nn.Module, *, base: float | None, scale: float,
                 freqs: mx.array | None):
        super().__init__()
        self._replaced = replaced  # underscored: not a child module, no parameters
        self.dims, self.traditional = replaced.dims, replaced.traditional
        self._base, self._scale, self._freqs = base, scale, freqs

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if not _kernel_applies(x):
            return self._replaced(x, offset)
        return kernels.rope(x, self.dims, traditional=self.traditional, base=self._base,
                            scale=self._scale, offset=offset, freqs=self._freqs)

    def _extra_repr(self) -> str:
        return f"{self._replaced}, on the CPU kernel"


def cpu_rope(module: nn.Module) -> CPURoPE | None:
    """The kernel version of ``module``, or None for a module kept as it is."""
    if type(module) is nn.RoPE:
        return CPURoPE(module, base=module.base, scale=module.scale, freqs=None)
    if type(module) in _FREQUENCY_MODULES:
        return CPURoPE(module, base=None, scale=1.0, freqs=module._freqs)
    return None


def use_cpu_rope(model: nn.Module) -> int:
    """Swap the model's supported rotary modules for ``CPURoPE``, in place; returns how
    many were swapped."""
    replacements = [(name, new) for name, m in model.named_modules()
                    if (new := cpu_rope(m)) is not None]
    if replacements:
        model.update_modules(tree_unflatten(replacements))
    return len(replacements)
