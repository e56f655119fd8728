"""mlxvlm: vision-language and omni models with MLX.

    import mlxvlm
    model, processor = mlxvlm.load("mlx-community/Qwen2.5-VL-3B-Instruct-4bit")
    print(mlxvlm.generate(model, processor, "Describe this image.", image="cat.jpg").text)
"""

from mlxvlm import _backend

# Must run before anything imports mlx.core (see _backend).
_backend.preload_openblas()

from mlxvlm.generate import GenerationResult, generate, stream_generate  # noqa: E402
from mlxvlm.loading import load  # noqa: E402

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate", "GenerationResult", "__version__"]
