"""What the other ranks of a sharded server run: rank 0's batch, pass by pass.

Each ``StepPlan`` rank 0 sends (``lockstep``) is applied to this rank's caches -- its
shard of every sequence's keys and values -- in the order rank 0 made the changes
(``add_row`` and ``keep_rows`` are the decode batch's own), then its pass runs on the
named cache with rank 0's inputs. Nothing is sampled here: the tokens come in the next
plan. A speculating sequence's cache is checkpointed before each pass and taken back to
the length rank 0 announces with the next one (``rewind``), as rank 0 took back the
drafts it rejected. A rank that loses rank 0 raises ``RankLostError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxvlm.batching.decode import add_row, keep_rows
from mlxvlm.distributed.jobs import PassCall, StepPlan, next_step
from mlxvlm.generate.cache import CacheOptions
from mlxvlm.generate.loop import generation_stream
from mlxvlm.generate.rewind import CacheCheckpoint
from mlxvlm.generate.state_cache import cache_offset
from mlxvlm.prompt import PreparedInputs


@dataclass
class _Held:
    """A sequence's own cache (while it prefills or speculates)."""

    cache: list
    state: Any = None
    checkpoint: CacheCheckpoint | None = None


class FollowerBatch:
    """This rank's caches for rank 0's sequences and batch."""

    def __init__(self, model: Any):
        self.model = model
        self.held: dict[int, _Held] = {}
        self.batch: list | None = None
        self.batch_state: Any = None
        self.cache_options = CacheOptions()
        self.passes = 0

    def apply(self, plan: StepPlan) -> None:
        for op in plan.ops:
            kind = op[0]
            if kind == "start":
                _, seq_id, input_ids, self.cache_options = op
                cache = self.cache_options.make(self.model, PreparedInputs(input_ids))
                self.held[seq_id] = _Held(cache)
            elif kind == "join":
                _, seq_id, merged = op
                cache = self.held.pop(seq_id).cache
                self.batch = add_row(self.batch, cache) if merged else cache
            elif kind == "keep":
                indices = op[1]
                if not indices:
                    self.batch = self.batch_state = None
                else:
                    keep_rows(self.batch, indices)
            else:
                raise RuntimeError(f"rank 0 sent an unknown change {kind!r}")
        if plan.live is not None:
            for seq_id in [s for s in self.held if s not in plan.live]:
                del self.held[seq_id]
        if plan.call is not None:
            self._run(plan.call)

    def _run(self, call: PassCall) -> None:
        if call.target is None:
            cache = self.batch
            if call.state_sent:
                self.batch_state = call.state
            state = self.batch_state
        else:
            held = self.held[call.target]
            cache = held.cache
            if call.state_sent:
                held.state = call.state
            state = held.state
            if held.checkpoint is not None and call.offset < cache_offset(cache):
                held.checkpoint.rewind(cache, call.offset - held.checkpoint.offset)
            # A pass without embeddings on a sequence's own cache is a speculative one,
            # whose rejected tokens rank 0 may take back before the next.
            held.checkpoint = CacheCheckpoint(cache) if call.embeddings is None else None
        with mx.stream(generation_stream):
            out = self.model(call.input_ids, cache, embeddings=call.embeddings, state=state,
                             last_only=call.last_only)
            mx.eval(out)
            self.cache_options.quantize(cache)
        self.passes += 1
        if self.passes % 256 == 0:
            mx.clear_cache()


def follow_batches(model: Any) -> int:
    """Run rank 0's passes until it releases this rank; returns how many ran."""
    batch = FollowerBatch(model)
    while (plan := next_step(model)) is not None:
        batch.apply(plan)
    return batch.passes
