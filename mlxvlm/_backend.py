"""Fast paths for MLX's CPU backend, set up before ``mlx.core`` is first imported.

The Linux ``mlx[cpu]`` wheel links the reference BLAS: a float32 256x1536x8960 matmul
takes ~4.9 s on a 2-core x86-64 machine, 0.07 s once the system OpenBLAS is loaded with
RTLD_GLOBAL before libmlx, because libmlx's ``cblas_sgemm`` then resolves to OpenBLAS.
Set ``MLXVLM_NO_OPENBLAS=1`` to opt out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# What happened, for --verbose: the library path loaded, or why none was.
openblas_status: str = "not attempted"


def preload_openblas() -> None:
    global openblas_status
    if sys.platform == "darwin":
        openblas_status = "not used on macOS (Accelerate/Metal)"
        return
    if os.environ.get("MLXVLM_NO_OPENBLAS", "").strip() not in ("", "0"):
        openblas_status = "disabled by MLXVLM_NO_OPENBLAS"
        return
    if "mlx.core" in sys.modules:
        openblas_status = "skipped: mlx.core was imported before mlxvlm"
        return
    name = ctypes.util.find_library("openblas")
    if name is None:
        openblas_status = (
            "not found (install it for ~10x faster CPU matmuls, "
            "e.g. `apt-get install libopenblas0-pthread`)"
        )
        return
    try:
        ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
    except OSError as exc:
        openblas_status = f"failed to load {name}: {exc}"
        return
    openblas_status = f"loaded {name}"
