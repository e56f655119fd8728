"""The door to the CPU backend: everything backend-neutral code (``models/``, loading,
fine-tuning, the CLI's ``--verbose``) uses of ``mlxvlm.cpu``, and nothing more.

Each entry computes the same thing on every backend. On MLX's CPU backend (and unless
``MLXVLM_NO_CPU_FAST_PATHS`` is set: ``policy``) it takes mlxvlm's fast paths; on Metal
and CUDA it is plain MLX, exactly as if this package did not exist.

- attention: ``scaled_dot_product_attention`` (``mx.fast``'s signature) and
  ``cached_attention`` (mlx-lm's, for text decoders with a KV cache);
- activations: ``gelu_tanh``, ``quick_gelu``, ``silu``, ``exp``, and ``gated(act)``
  for ``act(gate) * up``; ``logsumexp_last`` (a sampling step's normalization);
- rotations from cos/sin tables: ``rotary_takes_kernel`` / ``rotary`` (the composition
  itself is the model code's);
- residuals: ``residual_plus(residual, layer, x)``;
- at load: ``keeps_half_weights``, ``cast_to_float32_keeping_half_weights``,
  ``apply_cpu_fast_paths`` (its report is ``model.cpu_fast_paths``), and for training
  on a quantized base ``stream_quantized_layers``;
- for ``--verbose``: ``process_status`` (BLAS, threads, malloc) and ``kernels_status``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxvlm.cpu import attention as _attention
from mlxvlm.cpu import blas as _blas
from mlxvlm.cpu import fast_math as _fast_math
from mlxvlm.cpu import kernels as _kernels
from mlxvlm.cpu import malloc as _malloc
from mlxvlm.cpu import rotary as _rotary
from mlxvlm.cpu.half_weights import residual_plus

scaled_dot_product_attention = _attention.scaled_dot_product_attention
cached_attention = _attention.cached_attention

gelu_tanh = _fast_math.gelu_tanh
quick_gelu = _fast_math.quick_gelu
silu = _fast_math.silu
exp = _fast_math.exp
logsumexp_last = _fast_math.logsumexp_last
gated = _fast_math.gated

rotary_takes_kernel = _rotary.takes_kernel
rotary = _rotary.rotary

if TYPE_CHECKING:  # the report's type, without importing the rewrites
    from mlxvlm.cpu.fast_paths import FastPathReport as FastPathReport

__all__ = [
    "scaled_dot_product_attention", "cached_attention", "gelu_tanh", "quick_gelu", "silu",
    "exp", "logsumexp_last", "gated", "rotary_takes_kernel", "rotary", "residual_plus", "keeps_half_weights",
    "cast_to_float32_keeping_half_weights", "apply_cpu_fast_paths",
    "stream_quantized_layers", "process_status", "kernels_status",
]


# The load-time rewrites import their modules on first use: a program that never loads
# a model (the server's router, the CLI's --help) does not import them.
def keeps_half_weights() -> bool:
    from mlxvlm.cpu.fast_paths import keeps_half_weights

    return keeps_half_weights()


def cast_to_float32_keeping_half_weights(model) -> None:
    from mlxvlm.cpu.half_weights import cast_to_float32_keeping_half_weights

    cast_to_float32_keeping_half_weights(model)


def apply_cpu_fast_paths(model):
    """Rewrite ``model`` for the CPU backend, in place; returns a report with
    ``describe()`` (a no-op, reported as off, elsewhere)."""
    from mlxvlm.cpu.fast_paths import apply_cpu_fast_paths

    return apply_cpu_fast_paths(model)


def stream_quantized_layers(model) -> None:
    from mlxvlm.cpu.fast_paths import stream_quantized_layers

    stream_quantized_layers(model)


def process_status() -> list[tuple[str, str]]:
    """What was done to the process before MLX loaded, as (what, status) lines."""
    return [
        ("OpenBLAS", _blas.openblas_status),
        ("float32 products", _blas.gemv_forward_status),
        ("malloc", _malloc.malloc_status),
    ]


def kernels_status() -> str:
    """What the CPU kernels do here, or why they are not used."""
    return _kernels.describe()
