"""Speculative decoding of many requests at once: each row drafts its own tokens (prompt
lookup, the MTP head; a draft model drafts for all its rows at once, ``draft_batch``),
one batched pass of the target judges every row's drafts, and each row keeps its own accepted count
(``row_rewind``). Every row is judged exactly as ``generate.speculative`` judges one
sequence (``judge``, the greedy or speculative-sampling rule with its own generator), so
a greedy request answers as it would alone and a sampled one keeps the target's
distribution.

Not overlapped: the drafts of a pass need the tokens of the one before. A step with
``speculate`` off drafts nothing and is a plain batched step (each row's pending tokens
only), which is how the engine turns speculation off where it stops paying.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.batching.decode import add_row, keep_rows
from mlxvlm.batching.draft_batch import DraftBatch, batchable
from mlxvlm.batching.row_rewind import BatchCheckpoint
from mlxvlm.generate.acceptance import accept_greedy, accept_sampled, is_greedy, sampling_distribution
from mlxvlm.generate.loop import generation_stream
from mlxvlm.generate.mtp_drafter import MtpDrafter
from mlxvlm.generate.speculative import Drafter, SpeculationStats, fit_draft, judge
from mlxvlm.sampling import step_seed


@dataclass
class SpeculativeRow:
    seq: Any  # the engine's sequence
    drafter: Drafter
    prompt: list[int]
    emitted: list[int]  # every token delivered, the prefill's first included
    pending: list[int]  # emitted tokens the row's cache does not hold yet
    position: int  # tokens the row's cache holds
    rng: np.random.Generator
    stats: SpeculationStats
    held: list[int] = field(default_factory=list)  # the tokens fed after the prompt
    in_draft_batch: bool = False  # its drafter's rows live in the DraftBatch


@dataclass
class Verdict:
    """What one pass gave one row: its new tokens with their log-probabilities, or the
    row's own failure (its processors raised, or its scores were not numbers)."""

    tokens: list[int]
    logprobs: mx.array | None
    failure: Exception | None = None


class SpeculativeBatch:
    def __init__(self, model: nn.Module, num_draft_tokens: int):
        self.model = model
        self.num_draft_tokens = num_draft_tokens
        self.rows: list[SpeculativeRow] = []
        self.cache: list[Any] | None = None
        self.state: Any = None
        self.draft_batch: DraftBatch | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, seq: Any, cache: list[Any], drafter: Drafter, first: int,
             stats: SpeculationStats) -> None:
        """A prefilled request whose first token (already delivered) is ``first``."""
        self.cache = add_row(self.cache, cache)
        seed = seq.options.seed
        row = SpeculativeRow(seq, drafter, seq.inputs.input_ids[0].tolist(), [first], [first],
                             seq.inputs.num_tokens,
                             np.random.default_rng(None if seed is None else step_seed(seed, 0)),
                             stats)
        drafter.update(0, first)
        stats.note(drafter)
        if batchable(drafter):
            if self.draft_batch is None:
                self.draft_batch = DraftBatch(drafter.model)
            self.draft_batch.join(drafter)
            row.in_draft_batch = True
        self.rows.append(row)
        self._batch_states()

    def keep(self, indices: list[int]) -> None:
        if len(indices) == len(self.rows):
            return
        if self.draft_batch is not None:
            drafting = [i for i, row in enumerate(self.rows) if row.in_draft_batch]
            self.draft_batch.keep([drafting.index(i) for i in indices if i in drafting])
        self.rows = [self.rows[i] for i in indices]
        if not indices:
            self.cache = self.state = None
            return
        keep_rows(self.cache, indices)
        self._batch_states()

    def extract(self, index: int) -> list[Any]:
        return [layer.extract(index) for layer in self.cache]

    def _batch_states(self) -> None:
        self.state = self.model.batch_states([row.seq.state for row in self.rows])

    def step(self, speculate: bool = True) -> list[Verdict]:
        """One target pass over every row's pending tokens and (``speculate``) drafts."""
        rooms = []
        for row in self.rows:
            budget = row.seq.text.max_tokens - len(row.emitted) - 1
            rooms.append(max(min(self.num_draft_tokens + 1 - len(row.pending), budget), 0)
                         if speculate else 0)
        batched = iter(self.draft_batch.propose(
            [room for row, room in zip(self.rows, rooms) if row.in_draft_batch])
            if self.draft_batch else [])
        drafts, dists = [], []
        for row, room in zip(self.rows, rooms):
            if row.in_draft_batch:
                proposed, q = next(batched)
            elif room > 0:
                proposed, q = row.drafter.propose(row.prompt + row.emitted, room)
            else:
                proposed, q = [], None
            drafts.append(proposed)
            dists.append(q)
        feeds = [row.pending + d for row, d in zip(self.rows, drafts)]
        lengths = [len(f) for f in feeds]
        width = max(lengths)
        ids = mx.array([f + [0] * (width - len(f)) for f in feeds])
        checkpoint = BatchCheckpoint(self.cache, lengths)
        with mx.stream(generation_stream):
            logits = self._pass(ids, lengths)
        verdicts, keep, judged = [], [], []
        for i, (row, proposed, q) in enumerate(zip(self.rows, drafts, dists)):
            verdict, accepted = self._judge_row(row, logits[i, len(row.pending) - 1 : lengths[i]],
                                                proposed, q)
            verdicts.append(verdict)
            keep.append(0 if verdict.failure else len(row.pending) + accepted)
            outcome = None if verdict.failure else (accepted, verdict.tokens[-1])
            if outcome is not None and not row.in_draft_batch:
                row.drafter.update(*outcome)
            if row.in_draft_batch:
                judged.append(outcome)
        if self.draft_batch:
            self.draft_batch.update(judged)
            self._drop_stopped_drafts()
        for row in self.rows:
            row.stats.note(row.drafter)
        held = checkpoint.rewind(self.cache, keep)
        for row, verdict, feed, kept, now in zip(self.rows, verdicts, feeds, keep, held):
            row.held.extend(feed[:now])
            row.position += now
            if verdict.failure is None:
                row.pending = feed[now:kept] + verdict.tokens[-1:]
                row.emitted.extend(verdict.tokens)
        return verdicts

    def _drop_stopped_drafts(self) -> None:
        """Rows whose draft stopped (their sequence holds an id the draft's table lacks)
        leave the draft batch; they go on without drafts."""
        stopped = [row for row in self.rows if row.in_draft_batch and row.drafter.stopped]
        if not stopped:
            return
        self.draft_batch.keep([i for i, drafter in enumerate(self.draft_batch.rows)
                               if not drafter.stopped])
        for row in stopped:
            row.in_draft_batch = False

    def _pass(self, ids: mx.array, lengths: list[int]) -> mx.array:
        watching = [row for row in self.rows if isinstance(row.drafter, MtpDrafter)]
        if not watching:
            return self.model(ids, self.cache, state=self.state)
        # The MTP heads read the pass's hidden states, each row its own.
        target = watching[0].drafter.target
        hidden = target.hidden_states(ids, self.cache, None, self.state)
        embeddings = target.embed_tokens(ids)
        for i, row in enumerate(self.rows):
            if isinstance(row.drafter, MtpDrafter):
                row.drafter.state = row.seq.state
                row.drafter.record(row.position, embeddings[i : i + 1, : lengths[i]],
                                   hidden[i : i + 1, : lengths[i]])
        return target.logits(hidden)

    def _judge_row(self, row: SpeculativeRow, logits: mx.array, drafts: list[int],
                   q: np.ndarray | None) -> tuple[Verdict, int]:
        """The row's verdict, and how many of its drafts it accepted."""
        options = row.seq.options
        greedy = is_greedy(options)
        context = row.prompt + row.emitted
        try:
            logprobs, choice = judge(logits, row.seq.row, context, drafts, options, greedy)
        except Exception as e:  # its own processors: it fails alone
            return Verdict([], None, e), 0
        if greedy:
            accepted, next_token = accept_greedy(choice, drafts)
        else:
            p = sampling_distribution(logprobs, options)
            accepted, next_token = accept_sampled(p, drafts, fit_draft(q, p.shape[-1]), row.rng)
        tokens = [*drafts[:accepted], next_token]
        chosen = logprobs[mx.arange(len(tokens)), mx.array(tokens)]
        if not mx.all(mx.isfinite(chosen)).item():
            return Verdict([], None, FloatingPointError("scores were not numbers")), 0
        row.stats.drafted += len(drafts)
        row.stats.accepted += accepted
        row.stats.target_passes += 1
        row.stats.decoded += accepted + 1
        return Verdict(tokens, logprobs), accepted
