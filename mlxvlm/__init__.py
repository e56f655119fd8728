"""mlxvlm: vision-language and omni models with MLX.

    import mlxvlm
    model, processor = mlxvlm.load("mlx-community/Qwen2.5-VL-3B-Instruct-4bit")
    print(mlxvlm.generate(model, processor, "Describe this image.", image="cat.jpg").text)
"""

import warnings

from mlxvlm.cpu import startup

# Must run before anything imports mlx.core (see mlxvlm.cpu.blas).
startup.before_mlx()

# `python -m mlxvlm.generate` runs a module this package already imported (to export the
# `generate` function, as mlx-lm does); runpy's warning about that is harmless here.
warnings.filterwarnings(
    "ignore", message=r"'mlxvlm\.\w+' found in sys.modules", category=RuntimeWarning
)

# Before mlx-lm (whose __init__ imports transformers): transformers, imported first here,
# must find torch absent, or it imports it (see torch_free).
from mlxvlm.torch_free import keep_transformers_off_torch  # noqa: E402

keep_transformers_off_torch()

from mlxvlm.generate import (  # noqa: E402
    CacheOptions,
    GenerationOutput,
    GenerationResult,
    SpeculationOptions,
    generate,
    stream_generate,
)
from mlxvlm.media.options import MediaOptions  # noqa: E402
from mlxvlm.sampling import SamplingOptions  # noqa: E402
from mlxvlm.checkpoint.loading import load  # noqa: E402
from mlxvlm.batching import batch_generate  # noqa: E402

# The command's package first: importing it later would rebind ``mlxvlm.embed`` to it.
import mlxvlm.embed  # noqa: E402, F401
from mlxvlm.retrieval.api import embed, rerank  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "load",
    "generate",
    "stream_generate",
    "batch_generate",
    "embed",
    "rerank",
    "GenerationResult",
    "GenerationOutput",
    "SamplingOptions",
    "CacheOptions",
    "MediaOptions",
    "SpeculationOptions",
    "__version__",
]
