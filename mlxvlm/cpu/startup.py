"""What the CPU backend does to the process before ``mlx.core`` loads: the BLAS (OpenBLAS
and the shim, ``blas``) and malloc's thresholds (``malloc``). ``mlxvlm/process_setup.py``
calls ``before_mlx`` just before MLX's first import; nothing here imports MLX."""

from __future__ import annotations

from mlxvlm.cpu import blas, malloc


def before_mlx() -> None:
    blas.preload_openblas()
    malloc.tune_malloc()
