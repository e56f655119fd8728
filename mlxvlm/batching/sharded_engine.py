"""The server's engine on rank 0 of a sharded model: the batching engine, whose passes
every rank runs together.

Rank 0 schedules as one process does (admission, prefill chunks, joins and leaves,
decode steps, speculation with ``max_batch_size`` 1); its model is a ``LockstepModel``,
which sends each pass to the other ranks before running it, and its batch a
``LockstepBatch``, which tells them of joins and leaves (``sharded_follower`` replays
both). Rank 0 alone samples. A request that fails or is cancelled leaves the batch as on
one machine, and the others are told with the next pass; a rank that leaves fails the
requests running (``RankLostError``) and every later one. Requests do not reuse cached
prompt prefixes here: the other ranks would have to keep every cached prefix's shard.
"""

from __future__ import annotations

import logging
from typing import Any

from mlxvlm.batching.engine import BatchEngine
from mlxvlm.batching.lockstep import LockstepBatch, LockstepModel
from mlxvlm.distributed.jobs import announce_step, release_steps
from mlxvlm.errors import MlxvlmError

logger = logging.getLogger(__name__)


class ShardedEngine(BatchEngine):
    thread_name = "mlxvlm-sharded"
    carries_passes_to_ranks = True
    decode_batch_class = LockstepBatch

    def __init__(self, model, processor: Any, **options: Any):
        """``options``: the batching engine's, but for ``prefix_cache``."""
        if options.get("prefix_cache") is not None:
            raise MlxvlmError("a sharded model's server reuses no prompt prefixes")
        lockstep = LockstepModel(model, lambda plan: announce_step(model, plan),
                                 self._held_outside_batch)
        super().__init__(lockstep, processor, **options)

    def _held_outside_batch(self) -> list[int]:
        """The sequences whose own caches the engine holds (not yet or never batched)."""
        return [seq.handle.id for seq in (self._prefilling, self._speculating)
                if seq is not None]

    def _start_prefill(self, seq) -> None:
        super()._start_prefill(seq)
        self.model.started(seq.handle.id, seq.cache, seq.inputs.input_ids, self.cache_options)

    def step(self) -> None:
        super().step()
        if not self.has_work:  # idle: the other ranks free what left
            self.model.flush()

    def _run(self) -> None:
        try:
            super()._run()
        finally:  # closed: after the last step, on the thread that ran it
            self._finish()

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests; after the step under way, fail the requests left and
        release the other ranks. By default the step is waited out. Past a ``timeout``
        close returns, and the engine's thread releases the ranks when its step ends (a
        release sent while it runs would be read into its collectives)."""
        self._stop_thread(timeout)
        if self._thread is None:
            self._finish()
        elif self._thread.is_alive():
            logger.warning("the engine's step did not end within %s s: the other ranks are "
                           "released when it does", timeout)

    def _finish(self) -> None:
        error = MlxvlmError("the engine is shutting down")
        for seq in self._drain():
            self._deliver(seq, error)
        if self._thread is None:
            release_steps(self.model.model)
            return
        try:
            release_steps(self.model.model)
        except MlxvlmError as exc:  # (a rank already gone: nothing waits for this one)
            logger.warning("%s", exc)
