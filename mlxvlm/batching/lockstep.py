"""Rank 0's side of the sharded server's batch: the model as the batching engine sees
it, each forward pass carried to the other ranks before it runs.

The engine (``sharded_engine.ShardedEngine``) schedules exactly as on one machine; every
pass it makes -- a prefill chunk, a prompt's last chunk, a decode step over the batch, a
speculative pass -- goes through ``LockstepModel.__call__``, which first broadcasts a
``StepPlan``: the cache changes since the previous plan (a sequence started, joined the
batch, rows left), the sequences still held outside the batch, and the pass itself (its
tokens, its embeddings, the decoder's state where it changed). The other ranks
(``sharded_follower``) apply the plan to their shards' caches and run the same pass, so
one pass reads each weight once for every row on every rank. Rank 0 alone samples; the
tokens it feeds back reach the others in the next plan.

Every pass is evaluated before ``__call__`` returns: nothing that fails on rank 0 after
a pass is built (a request's grammar raising while its token is sampled) can leave the
others waiting inside that pass's collectives, and the next plan's broadcast never runs
beside a pass still in flight.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import mlx.core as mx

from mlxvlm.batching.decode import DecodeBatch
from mlxvlm.distributed.group import peer_lost
from mlxvlm.distributed.jobs import PassCall, StepPlan
from mlxvlm.generate.state_cache import cache_offset


class LockstepModel:
    """``model`` (rank 0's shard), whose calls are announced to the other ranks through
    ``announce(plan)``; every other attribute is the model's. ``live()`` names the
    sequences whose own caches the engine still holds (prefilling, speculating)."""

    def __init__(self, model: Any, announce: Callable[[StepPlan], None],
                 live: Callable[[], Iterable[int]]):
        self.model = model
        self._announce = announce
        self._live = live
        self._ops: list = []
        self._caches: dict[int, tuple[list, int]] = {}  # id(a sequence's cache) -> it, its id
        self._sent_states: dict[int | None, Any] = {}  # target -> the state last sent
        self._sent_live: set[int] = set()
        self.batch: DecodeBatch | None = None  # the engine's, once made (LockstepBatch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)

    # -- what the engine tells the other ranks -----------------------------------------

    def started(self, seq_id: int, cache: list, input_ids: mx.array, cache_options: Any) -> None:
        """Sequence ``seq_id`` has its own new ``cache`` (made by ``cache_options`` for
        the prompt ``input_ids``); its passes name it."""
        self._caches[id(cache)] = (cache, seq_id)
        self._ops.append(("start", seq_id, input_ids, cache_options))

    def joined(self, seq_id: int, merged: bool) -> None:
        self._ops.append(("join", seq_id, merged))

    def kept(self, indices: list[int]) -> None:
        self._ops.append(("keep", list(indices)))

    def flush(self) -> None:
        """Send the changes not sent yet (rank 0 going idle: the others free what left)."""
        if self._ops or set(self._live()) != self._sent_live:
            self._send(None)

    # -- a pass ----------------------------------------------------------------------

    def __call__(self, input_ids: mx.array, cache: list, *, embeddings: mx.array | None = None,
                 state: Any = None, last_only: bool = False) -> mx.array:
        if self.batch is not None and cache is self.batch.cache:
            target, offset = None, None
        else:
            target, offset = self._caches[id(cache)][1], cache_offset(cache)
        sent = self._sent_states.get(target, _NOTHING) is state
        if not sent:
            self._sent_states[target] = state
        self._send(PassCall(target, input_ids, embeddings, None if sent else state, not sent,
                            last_only, offset))
        out = self.model(input_ids, cache, embeddings=embeddings, state=state,
                         last_only=last_only)
        try:
            mx.eval(out)
        except RuntimeError as exc:
            if str(exc).startswith(_BACKEND_ERRORS):  # a collective in the pass failed
                raise peer_lost(exc, self.model.sharding.group) from None
            raise
        return out

    def _send(self, call: PassCall | None) -> None:
        live = set(self._live())
        if call is not None and call.target is not None:
            live.add(call.target)  # (a prompt's last pass: no longer prefilling, not batched yet)
        for key, (_, seq_id) in list(self._caches.items()):
            if seq_id not in live:
                del self._caches[key]
        for target in list(self._sent_states):
            if target is not None and target not in live:
                del self._sent_states[target]
        ops, self._ops = self._ops, []
        changed = live != self._sent_live
        self._sent_live = live
        self._announce(StepPlan(ops, tuple(sorted(live)) if changed else None, call))


_NOTHING = object()
# How MLX's distributed backends begin the errors of a collective that failed.
_BACKEND_ERRORS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")


class LockstepBatch(DecodeBatch):
    """The decode batch of ``LockstepModel``: its joins and leaves announced with the
    next plan, so that the other ranks lay out their batched caches as rank 0 does."""

    model: LockstepModel

    def __init__(self, model: LockstepModel, **kwargs: Any):
        super().__init__(model, **kwargs)
        model.batch = self

    def join(self, seq: Any, cache: list[Any], state: Any, token: mx.array,
             logprobs: mx.array) -> None:
        super().join(seq, cache, state, token, logprobs)
        self.model.joined(seq.handle.id, self.merged)

    def keep(self, indices: list[int]) -> None:
        if len(indices) != len(self.rows):
            self.model.kept(indices)
        super().keep(indices)
