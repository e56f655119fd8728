"""What every rank but rank 0 runs: rank 0's generations, in step, printing nothing.

The CLI's and the server's other ranks load their shard and then ``follow``: each
``GenerationJob`` rank 0 announces runs through the same ``generate_prepared`` as on
rank 0 (the same prefill chunks, the same decode steps, rank 0's tokens), until rank 0
releases them. A rank that loses rank 0 raises ``RankLostError``.
"""

from __future__ import annotations

from typing import Any

from mlxvlm.distributed.jobs import next_job
from mlxvlm.generate.stream import generate_prepared
from mlxvlm.prompt import PreparedInputs


def follow(model, processor: Any) -> int:
    """Run rank 0's jobs until it releases this rank; returns how many ran."""
    count = 0
    while (job := next_job(model)) is not None:
        inputs = PreparedInputs(job.input_ids)
        for _ in generate_prepared(model, processor, inputs, job.options, job.cache_options,
                                   prefill_step_size=job.prefill_step_size, job=job):
            pass
        count += 1
    return count
