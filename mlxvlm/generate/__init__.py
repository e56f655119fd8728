"""Generation of one sequence, shared by every entry point.

``stream_generate``/``generate`` (``stream``) run one prompt through the shared token
loop (``loop``: chunked prefill, one sampling step per token), their keywords folded
into options objects by ``keywords``; ``cache`` makes the KV
cache and ``text`` turns tokens into text and decides when a sequence ends. The batching
engine (``mlxvlm.batching``) builds on the same pieces. ``python -m mlxvlm.generate`` is
the command line (``__main__``, through ``mlxvlm.cli``); nothing here imports it.
"""

from mlxvlm.generate.cache import (
    DEFAULT_QUANTIZED_KV_START,
    ROTATING_KEEP,
    CacheOptions,
    make_generation_cache,
)
from mlxvlm.generate.loop import (
    embed_prompt,
    fit_to_context,
    generate_tokens,
    generation_stream,
    prefill_chunks,
)
from mlxvlm.generate.speculative import SpeculationOptions
from mlxvlm.generate.stream import GenerationResult, generate, sampling_options, stream_generate
from mlxvlm.generate.text import (
    GenerationOutput,
    OutputFolder,
    SequenceText,
    StopStrings,
    eos_token_ids,
)

__all__ = [
    "DEFAULT_QUANTIZED_KV_START", "ROTATING_KEEP", "CacheOptions", "GenerationOutput",
    "GenerationResult", "OutputFolder", "SequenceText", "SpeculationOptions", "StopStrings", "embed_prompt",
    "eos_token_ids", "fit_to_context", "generate", "generate_tokens", "generation_stream",
    "make_generation_cache", "prefill_chunks", "sampling_options", "stream_generate",
]
