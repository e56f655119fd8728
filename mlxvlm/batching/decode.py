"""The requests that decode together, and one overlapped decode step over them.

Each request's cache is one row of mlx-lm's batched KV caches (per-row offsets, left
padding) and its position state one row of the family's ``batch_states``; in a batch of
at most one (``max_batch_size`` 1) the request keeps its own cache and state, exactly as
``generate`` decodes, which is also what lets quantized caches (mlx-lm has no batched
one) and rotating caches that keep the prompt's media be used there.

The batch holds each row's latest sampled token while it is still being computed: a
step is scheduled on those tokens (``mx.async_eval``) before they are read, so building
step n + 1 overlaps step n's computation, as mlx-lm's batch generator does.

A row is one request's alone: its processors failing while a step is built (its
``RowSampler.failure``) or its token drawn from no real distribution (``sane``, read
with the tokens) is its own failure, which the engine delivers to that request only.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.loop import generation_stream
from mlxvlm.sampling import RowSampler, sampled_sanely, sampling_step


def add_row(batch_cache: list[Any] | None, cache: list[Any]) -> list[Any]:
    """``cache`` (one sequence's) as the last row of ``batch_cache`` (mlx-lm's batched
    caches, None before the first row); the batch's caches. Shared with the other ranks
    of a sharded server, whose batches must be laid out as rank 0's."""
    row = []
    for layer_cache in cache:
        if not hasattr(layer_cache, "merge"):
            raise MlxvlmError(
                f"{type(layer_cache).__name__} caches cannot be batched; "
                "serve this model with --max-concurrency 1"
            )
        row.append(layer_cache.merge([layer_cache]))
    if batch_cache is None:
        return row
    for batch_layer, row_layer in zip(batch_cache, row):
        batch_layer.extend(row_layer)
    return batch_cache


def keep_rows(batch_cache: list[Any], indices: list[int]) -> None:
    """Only the rows ``indices`` of ``batch_cache``, in that order."""
    for layer in batch_cache:
        layer.filter(indices)


class DecodeBatch:
    def __init__(self, model: nn.Module, *, merged: bool,
                 quantize: Callable[[list[Any]], None] | None = None):
        self.model = model
        self.merged = merged  # rows in mlx-lm's batched caches (else one row, its own)
        self.quantize = quantize or (lambda _: None)
        self.rows: list[Any] = []  # the engine's sequences, one per row
        self.samplers: list[RowSampler] = []
        self.cache: list[Any] | None = None
        self.state: Any = None
        self.tokens: mx.array | None = None  # (B,) each row's latest sampled token
        self.logprobs: mx.array | None = None  # (B, vocabulary) and their distributions
        self.sane: mx.array | None = None  # (B,) whether each token's draw was sound
        self.unread: list[bool] = []  # whose latest token is not delivered yet

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, seq: Any, cache: list[Any], state: Any, token: mx.array,
             logprobs: mx.array) -> None:
        """Add a prefilled request whose first token (already delivered) is ``token``."""
        if self.merged:
            self.cache = add_row(self.cache, cache)
        else:
            if self.rows:
                raise RuntimeError("a batch of one already has its row")
            self.cache, self.state = cache, state
        token = token.reshape(1).astype(mx.int32)
        logprobs = logprobs.reshape(1, -1)
        sane = mx.array([True])  # the engine checked the first token after the prefill
        first = not self.rows
        self.tokens = token if first else mx.concatenate([self.tokens, token])
        self.logprobs = logprobs if first else mx.concatenate([self.logprobs, logprobs])
        self.sane = sane if first else mx.concatenate([self.sane, sane])
        self.rows.append(seq)
        self.samplers.append(seq.row)
        self.unread.append(False)
        self._batch_states()

    def keep(self, indices: list[int]) -> None:
        if len(indices) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in indices]
        self.samplers = [self.samplers[i] for i in indices]
        self.unread = [self.unread[i] for i in indices]
        if not indices:
            self.cache = self.state = self.tokens = self.logprobs = self.sane = None
            return
        if self.merged:
            keep_rows(self.cache, indices)
        select = mx.array(indices)
        self.tokens, self.logprobs = self.tokens[select], self.logprobs[select]
        self.sane = self.sane[select]
        self._batch_states()

    def clear(self) -> None:
        self.keep([])

    def extract(self, index: int) -> list[Any]:
        """Row ``index``'s cache on its own (B=1), e.g. for the prefix cache."""
        if not self.merged:
            return self.cache
        return [layer.extract(index) for layer in self.cache]

    def _batch_states(self) -> None:
        if self.merged:
            self.state = self.model.batch_states([seq.state for seq in self.rows])

    def step(self) -> None:
        """Feed every row its latest token and schedule the sampling of the next ones;
        ``tokens`` and ``logprobs`` become those (being computed), all unread."""
        with mx.stream(generation_stream):
            fed = self.tokens
            logits = self.model(fed[:, None], self.cache, state=self.state, last_only=True)
            self.quantize(self.cache)
            tokens, logprobs = sampling_step(logits[:, -1, :], self.samplers, fed,
                                             isolate=True)
            self.tokens = tokens.astype(mx.int32)
            self.logprobs = logprobs
            self.sane = sampled_sanely(tokens, logprobs)
        mx.async_eval(self.tokens, self.logprobs, self.sane)
        self.unread = [True] * len(self.rows)
