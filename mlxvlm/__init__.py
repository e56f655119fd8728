"""mlxvlm: vision-language and omni models with MLX.

    import mlxvlm
    model, processor = mlxvlm.load("mlx-community/Qwen2.5-VL-3B-Instruct-4bit")
    print(mlxvlm.generate(model, processor, "Describe this image.", image="cat.jpg").text)

Importing the package loads nothing else: each public name is imported on first use, and
the process set-up MLX and transformers need (``process_setup``) waits for their first
import.
"""

import importlib
import sys
import types
import warnings

from mlxvlm import process_setup

process_setup.install()

# `python -m mlxvlm.generate` runs a module this package already imported (to export the
# `generate` function, as mlx-lm does); runpy's warning about that is harmless here.
warnings.filterwarnings(
    "ignore", message=r"'mlxvlm\.\w+' found in sys.modules", category=RuntimeWarning
)

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "load": "mlxvlm.checkpoint.loading",
    "generate": "mlxvlm.generate",
    "stream_generate": "mlxvlm.generate",
    "GenerationResult": "mlxvlm.generate",
    "GenerationOutput": "mlxvlm.generate",
    "CacheOptions": "mlxvlm.generate",
    "SpeculationOptions": "mlxvlm.generate",
    "MediaOptions": "mlxvlm.media.options",
    "SamplingOptions": "mlxvlm.sampling",
    "batch_generate": "mlxvlm.batching",
    "embed": "mlxvlm.retrieval.api",
    "rerank": "mlxvlm.retrieval.api",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mlxvlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """``mlxvlm.generate`` and ``mlxvlm.embed`` are functions (as mlx-lm's ``generate``
    is), though subpackages (the commands) have the same names: importing one would
    otherwise bind it over the function."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and name in _PUBLIC:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
