"""What the CPU backend does to the process before ``mlx.core`` loads: the BLAS (OpenBLAS
and the shim, ``blas``) and malloc's thresholds (``malloc``). ``mlxvlm/__init__.py``
calls ``before_mlx`` first; nothing here imports MLX."""

from __future__ import annotations

from mlxvlm.cpu import blas, malloc


def before_mlx() -> None:
    blas.preload_openblas()
    malloc.tune_malloc()
