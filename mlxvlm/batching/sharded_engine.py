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

A pass whose peer is gone can also wait in MLX's collectives forever, with the engine's
thread inside it: ``abandon`` (called from another thread, by whoever saw the peer go or
gave up waiting) fails the requests still running and refuses later ones, and ``stuck``
says whether the thread outlived ``close``. Each request's results pass through a gate,
so that nothing reaches it after the error abandon gave it, whatever that thread does
once (if ever) its pass returns.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from mlxvlm.batching.engine import BatchEngine, BatchStep, Deliver, SequenceHandle
from mlxvlm.batching.lockstep import LockstepBatch, LockstepModel
from mlxvlm.distributed.jobs import announce_step, release_steps
from mlxvlm.errors import MlxvlmError

logger = logging.getLogger(__name__)

# How long close still waits for the step of an abandoned engine: one whose other ranks
# are there ends it in a moment (and releases them); one that waits on a lost rank never.
ABANDONED_WAIT = 2.0


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
        self._gates_lock = threading.Lock()
        self._gates: set[_Gate] = set()  # the requests not yet ended
        self._abandoned: BaseException | None = None
        # Once every other rank took the release: from then on they leave, as they should.
        self.released = False

    def submit(self, inputs: Any, options: Any, deliver: Deliver, **kwargs: Any) -> SequenceHandle:
        gate = _Gate(deliver, self._ended)
        with self._gates_lock:
            if self._abandoned is not None:
                raise self._abandoned
            self._gates = {g for g in self._gates if not g.cancelled}
            self._gates.add(gate)
        try:
            gate.handle = super().submit(inputs, options, gate, **kwargs)
        except BaseException:
            self._ended(gate)
            raise
        return gate.handle

    def _ended(self, gate: "_Gate") -> None:
        with self._gates_lock:
            self._gates.discard(gate)

    def abandon(self, error: BaseException) -> int:
        """Fail every request not yet ended with ``error``, and every later ``submit``,
        without waiting for the engine's thread (which may never return from its pass);
        how many were failed. Any thread may call it."""
        with self._gates_lock:
            if self._abandoned is None:
                self._abandoned, self._abandoned_at = error, time.monotonic()
            gates, self._gates = self._gates, set()
        failed = 0
        for gate in gates:
            failed += gate.fail(error)
        return failed

    @property
    def stuck(self) -> bool:
        """Whether the engine's thread is still inside a pass after ``close`` returned."""
        return self._closed and self._thread is not None and self._thread.is_alive()

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
        release the other ranks. By default the step is waited out, unless the engine is
        (or gets) abandoned meanwhile: then for ``ABANDONED_WAIT`` seconds at most, as its
        step may never end. Past a ``timeout`` close returns, and the engine's thread
        releases the ranks when its step ends (a release sent while it runs would be read
        into its collectives)."""
        self._stop_thread(0)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._thread is not None and self._thread.is_alive():
            now = time.monotonic()
            if self._abandoned is not None and self._abandoned_at + ABANDONED_WAIT < now:
                break
            if deadline is not None and deadline < now:
                break
            self._thread.join(0.1)
        if self._thread is None:
            self._finish()
        elif self._thread.is_alive():
            logger.warning("the engine's step did not end within %s s%s: the other ranks are "
                           "released when it does",
                           ABANDONED_WAIT if self._abandoned else timeout,
                           " of its abandonment" if self._abandoned else "")

    def _finish(self) -> None:
        error = MlxvlmError("the engine is shutting down")
        for seq in self._drain():
            self._deliver(seq, error)
        if self._thread is None:
            release_steps(self.model.model)
            self.released = True
            return
        try:
            release_steps(self.model.model)
            self.released = True
        except MlxvlmError as exc:  # (a rank already gone: nothing waits for this one)
            logger.warning("%s", exc)


class _Gate:
    """A request's ``deliver``, closed by its last result or by ``fail``: nothing passes
    after either."""

    def __init__(self, deliver: Deliver, ended):
        self._deliver = deliver
        self._ended = ended
        self._lock = threading.Lock()
        self._open = True
        self.handle: SequenceHandle | None = None

    @property
    def cancelled(self) -> bool:
        return self.handle is not None and self.handle.cancelled

    def __call__(self, item: "BatchStep | BaseException") -> None:
        last = not isinstance(item, BatchStep) or item.finish_reason is not None
        with self._lock:
            if not self._open:
                return
            self._open = not last
        if last:
            self._ended(self)
        self._deliver(item)

    def fail(self, error: BaseException) -> bool:
        """Deliver ``error`` unless the request already ended; whether it did."""
        with self._lock:
            if not self._open:
                return False
            self._open = False
        if self.cancelled:
            return False
        try:
            self._deliver(error)
        except Exception:  # (its consumer gone)
            return False
        return True
