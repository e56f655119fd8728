"""A draft model's drafting for every row of a speculating batch at once: the rows'
draft caches are rows of one batched cache, and each draft step is one batched pass of
the draft model (K passes for the whole batch, not K per row).

Each row keeps what ``DraftModelDrafter`` keeps for one sequence -- the accepted tokens
its draft cache has not been fed yet, its generator, its drafts -- and is drafted exactly
as that drafter drafts it: the first pass feeds every row's pending tokens (right-padded,
``row_rewind``'s way) and draws each row's first draft from its own last position; every
further pass feeds each row its previous draft. A row that may draft fewer tokens than
the most (its budget, or nothing this step) rides along and has the extra steps taken
back. After the target's verdict each row keeps its accepted drafts in the draft cache
(``row_rewind``; a recurrent draft layer that cannot keeps none, and they are fed again
with the next step's pending tokens). Each row's drafts are cut at the first id the
target's table lacks, and a row whose sequence comes to hold an id the draft's table lacks
stops drafting (``DraftModelDrafter.stopped``; the speculating batch takes it out).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxvlm.batching.decode import add_row, keep_rows
from mlxvlm.batching.row_rewind import BatchCheckpoint, rewindable
from mlxvlm.generate.acceptance import sampling_distribution
from mlxvlm.generate.drafters import DraftModelDrafter
from mlxvlm.generate.loop import generation_stream


def batchable(drafter: Any) -> bool:
    """Whether a row's drafter can draft in a batch here (a draft model whose cache can be
    taken back row by row)."""
    return (type(drafter) is DraftModelDrafter and not drafter.stopped
            and rewindable(drafter.cache)
            and (not drafter.is_vlm or hasattr(drafter.model, "batch_states")))


class DraftBatch:
    def __init__(self, model: Any):
        self.model = model
        self.rows: list[DraftModelDrafter] = []
        self.cache: list[Any] | None = None
        self.state: Any = None
        self.checkpoint: BatchCheckpoint | None = None  # before the chained draft steps
        self.drafts: list[list[int]] = []
        self.chained = 0  # draft steps fed after the pending tokens

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, drafter: DraftModelDrafter) -> None:
        """A row whose drafter has prefilled its prompt (its own B=1 cache)."""
        self.cache = add_row(self.cache, drafter.cache)
        drafter.cache = None  # its rows live here now
        self.rows.append(drafter)
        self._batch_states()

    def keep(self, indices: list[int]) -> None:
        if len(indices) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in indices]
        if not indices:
            self.cache = self.state = None
            return
        keep_rows(self.cache, indices)
        self._batch_states()

    def _batch_states(self) -> None:
        if self.rows and self.rows[0].is_vlm:
            self.state = self.model.batch_states([row.state for row in self.rows])

    def _logits(self, ids: mx.array) -> mx.array:
        if self.rows[0].is_vlm:
            return self.model(ids, self.cache, state=self.state)
        return self.model(ids, cache=self.cache)

    def propose(self, rooms: list[int]) -> list[tuple[list[int], np.ndarray | None]]:
        """Each row's drafts (at most ``rooms[i]``) and, for sampled rows, their
        distributions."""
        self.drafts = [[] for _ in self.rows]
        self.checkpoint, self.chained = None, 0
        most = max(rooms)
        if most == 0:
            return [([], None) for _ in self.rows]
        pending = [row.pending for row in self.rows]
        lengths = [len(p) for p in pending]
        width = max(lengths)
        fed = BatchCheckpoint(self.cache, lengths)
        with mx.stream(generation_stream):
            logits = self._logits(mx.array([p + [0] * (width - len(p)) for p in pending]))
            logits = self.rows[0].fitted(logits[mx.arange(len(self.rows)), mx.array(lengths) - 1])
        fed.rewind(self.cache, lengths)  # the pads out; every row keeps its pending tokens
        for row in self.rows:
            row.pending = []
        dists: list[list[np.ndarray]] = [[] for _ in self.rows]
        tokens = self._draw(logits, dists, [room > 0 for room in rooms])
        self.checkpoint = BatchCheckpoint(self.cache, [most - 1] * len(self.rows))
        chain = [tokens]
        for step in range(1, most):
            with mx.stream(generation_stream):
                logits = self.rows[0].fitted(self._logits(chain[-1][:, None])[:, -1, :])
            chain.append(self._draw(logits, dists, [room > step for room in rooms]))
        self.chained = most - 1
        drafted = mx.stack(chain, axis=1).tolist()
        proposals = []
        for i, (row, room) in enumerate(zip(self.rows, rooms)):
            q = np.stack(dists[i][:room]) if room and not row.greedy else None
            self.drafts[i], q = row.within_target(drafted[i][:room], q)
            proposals.append((self.drafts[i], q))
        return proposals

    def _draw(self, logits: mx.array, dists: list[list[np.ndarray]],
              wanted: list[bool]) -> mx.array:
        """Each row's next draft from its logits: the argmax for greedy rows, else drawn
        from the row's own sampling distribution with its own generator -- only for the
        ``wanted`` rows (another row's generator is not drawn from for a step it does not
        draft, as it would not be alone)."""
        logits = logits.astype(mx.float32)
        greedy = mx.argmax(logits, axis=-1)
        if all(row.greedy for row in self.rows):
            return greedy
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = greedy.tolist()
        for i, row in enumerate(self.rows):
            if wanted[i] and not row.greedy:
                q = sampling_distribution(logprobs[i : i + 1], row.options)[0]
                chosen[i] = int(row.rng.choice(q.shape[-1], p=q))
                dists[i].append(q)
        return mx.array(chosen)

    def update(self, verdicts: list[tuple[int, int] | None]) -> None:
        """Each row's ``(accepted, next_token)`` (None: the row failed and leaves)."""
        rows = len(self.rows)
        keep = [0] * rows
        for i, verdict in enumerate(verdicts):
            if verdict is not None and self.drafts[i]:
                keep[i] = min(verdict[0], len(self.drafts[i]) - 1, self.chained)
        held = keep if self.checkpoint is None else self.checkpoint.rewind(self.cache, keep)
        for i, (row, verdict) in enumerate(zip(self.rows, verdicts)):
            if verdict is None:
                continue
            accepted, next_token = verdict
            if not self.drafts[i]:  # nothing drafted: the token waits for the next step
                row.take([*row.pending, next_token])
                continue
            row.take([*self.drafts[i][held[i]:accepted], next_token])
        self.checkpoint, self.drafts, self.chained = None, [], 0

