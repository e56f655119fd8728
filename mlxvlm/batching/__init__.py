"""Continuous batching: ``BatchEngine`` (``engine``; the server's and the UI's core),
``DecodeBatch`` (``decode``: the rows decoding together, one overlapped step over them),
``BatchAudio`` (``spoken_rows``: a spoken request's audio, delivered between its steps)
and ``batch_generate`` (``api``: the one-call Python API). ``SamplingOptions`` lives in
``mlxvlm.sampling`` (one for every path) and is importable here as before."""

from mlxvlm.batching.api import batch_generate
from mlxvlm.batching.decode import DecodeBatch
from mlxvlm.batching.spoken_rows import BatchAudio
from mlxvlm.batching.engine import (
    BatchEngine,
    BatchStep,
    Deliver,
    EngineFault,
    EngineStats,
    SequenceFault,
    SequenceHandle,
)
from mlxvlm.sampling.ranges import MAX_TOP_LOGPROBS  # noqa: F401  (its old home)
from mlxvlm.sampling import SamplingOptions

__all__ = [
    "BatchAudio", "BatchEngine", "BatchStep", "DecodeBatch", "Deliver", "EngineFault", "EngineStats",
    "SamplingOptions", "SequenceFault", "SequenceHandle", "batch_generate",
]
