"""Drafting with the checkpoint's own multi-token-prediction head (``--mtp``).

The head (``models/layers/mtp_head.py``) needs, for each target position ``i``, the
target's final hidden state there and the embedding of the token at ``i + 1``: its slot
``i`` then predicts the token at ``i + 2``. So the drafter watches every pass of the
target (``recording``: the target called through this drafter computes its hidden states
apart from its logits and hands them over), and after each verdict feeds the head the
slots the accepted tokens complete -- prompt chunks as they are prefilled (the prompt's
own embeddings, image features included), then the tokens each pass kept. The last slot's
output drafts the first token; each further draft chains one head step on the previous
step's output and its own token.

The head keeps its own KV cache. Slots come in two kinds: committed ones, from the
target's hidden states, and the chained steps of a draft, which are trimmed at the next
verdict (a draft's hidden states are the head's guesses, not the target's). Pending
hidden states and embeddings are kept by absolute position, so a pass whose kept tokens
are fed again (a recurrent cache rewound to its checkpoint) is not counted twice.

A prompt prefix reused from the server's prompt cache brought no hidden states: the
head's cache starts at the first position prefilled (``first_position``), still at the
target's positions; it drafts from less context there, which costs acceptance, never
correctness.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.generate.acceptance import is_greedy, sampling_distribution
from mlxvlm.generate.loop import generation_stream
from mlxvlm.generate.state_cache import cache_offset
from mlxvlm.sampling import SamplingOptions


class _Rows:
    """Rows (1, n, width) of one kind for consecutive target positions from ``start``."""

    def __init__(self, start: int):
        self.start = start
        self.rows: mx.array | None = None

    @property
    def end(self) -> int:
        return self.start + (0 if self.rows is None else self.rows.shape[1])

    def extend(self, first: int, rows: mx.array) -> None:
        """Rows for positions ``[first, first + n)``; those already held are skipped."""
        if first > self.end:
            raise ValueError(f"positions {self.end} to {first} were never recorded")
        skip = self.end - first
        if skip >= rows.shape[1]:
            return
        rows = rows[:, skip:]
        self.rows = rows if self.rows is None else mx.concatenate([self.rows, rows], axis=1)

    def take(self, n: int) -> mx.array:
        taken, rest = self.rows[:, :n], self.rows[:, n:]
        self.rows = rest if rest.shape[1] else None
        self.start += n
        return taken


class RecordingTarget:
    """The target model called through an MTP drafter: the same logits, with each pass's
    hidden states handed to the drafter. Other attributes are the model's."""

    def __init__(self, model: nn.Module, drafter: "MtpDrafter"):
        self._model = model
        self._drafter = drafter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, input_ids, cache, *, embeddings=None, state=None, last_only=False):
        target = self._drafter.target
        start = cache_offset(cache)
        hidden = target.hidden_states(input_ids, cache, embeddings, state)
        if embeddings is None:
            embeddings = target.embed_tokens(input_ids)
        self._drafter.state = state  # the head rotates as the target does
        self._drafter.record(start, embeddings, hidden)
        return target.logits(hidden[:, -1:] if last_only else hidden)


class MtpDrafter:
    """Drafts with the model's MTP head, sampled as the target samples (greedy for
    greedy); see the module's docstring."""

    def __init__(self, model: nn.Module, options: SamplingOptions, *,
                 first_position: int = 0, chunk: int = 2048, seed: int | None = None):
        self.target = model.multi_token_predictor()  # refuses a model without a head
        self.options = options
        self.greedy = is_greedy(options)
        self.rng = np.random.default_rng(seed)
        self.state: Any = None  # the request's positions, from the target's passes
        self.chunk = chunk
        self.cache = self.target.make_cache()
        self.slots = first_position  # the next committed slot's position
        self.first_position = first_position
        self.hidden = _Rows(first_position)  # target hidden states from self.slots on
        self.embeddings = _Rows(first_position + 1)  # the next tokens' embeddings
        self.passes: list[tuple[int, mx.array, mx.array]] = []
        self.drafts: list[int] = []
        self.last: mx.array | None = None  # the last committed slot's output
        self.offsets: list[int] | None = None  # the head's cache before the chained steps

    def recording(self, model: nn.Module) -> RecordingTarget:
        return RecordingTarget(model, self)

    # -- the target's passes and verdicts ----------------------------------------------

    def record(self, start: int, embeddings: mx.array, hidden: mx.array) -> None:
        """A pass of the target from position ``start``. The passes before it are
        confirmed whole (only a verdict's pass has rejected tokens): they are committed
        now, so that a long prompt's states go through the head chunk by chunk."""
        if self.passes:
            self._take_rows(self.passes)
            self.passes = []
            self._trim_chained()
            self._commit(evaluate=True)
        self.passes.append((start, embeddings, hidden))

    def _take_rows(self, passes) -> None:
        for start, emb, hid in passes:
            self.hidden.extend(start, hid)
            self.embeddings.extend(start, emb)

    def update(self, accepted: int, next_token: int) -> None:
        """Commit what the recorded passes confirmed: all of every pass but the last, and
        of the last its tokens but the rejected drafts; then ``next_token``."""
        if not self.passes:  # every verdict follows a pass: the target was called directly
            raise RuntimeError("the MTP drafter saw no pass of the target (call the target "
                               "through drafter.recording(model))")
        *confirmed, (start, emb, hid) = self.passes
        kept = hid.shape[1] - len(self.drafts) + accepted
        confirmed.append((start, emb[:, :kept], hid[:, :kept]))
        end = start + kept
        self._take_rows(confirmed)
        self.passes, self.drafts = [], []
        self._trim_chained()
        with mx.stream(generation_stream):
            next_embedding = self.target.embed_tokens(mx.array([[next_token]]))
        self.embeddings.extend(end, next_embedding)
        self._commit()

    def _trim_chained(self) -> None:
        """Take the last draft's chained steps out of the head's cache."""
        if self.offsets is not None:
            for layer_cache, offset in zip(self.cache, self.offsets):
                layer_cache.trim(layer_cache.offset - offset)
        self.offsets = None

    def _commit(self, evaluate: bool = False) -> None:
        """Run the head over every slot both inputs are known for, in chunks; evaluated
        chunk by chunk where ``evaluate`` (a prompt), else the last chunk is left to the
        next draft's read (a verdict's few slots)."""
        with mx.stream(generation_stream):
            while True:
                n = min(self.hidden.end, self.embeddings.end - 1) - self.slots
                if n <= 0:
                    break
                n = min(n, self.chunk)
                position = self.slots
                out = self.target.step(self.embeddings.take(n), self.hidden.take(n),
                                       self.cache, self.state, position)
                self.slots += n
                self.last = out[:, -1:]
                if evaluate or n == self.chunk:
                    mx.eval(self.last, [c.state for c in self.cache])

    # -- drafting ---------------------------------------------------------------------

    def _logits(self, hidden: mx.array) -> mx.array:
        return self.target.logits(hidden)[:, -1, :].astype(mx.float32)

    def _draw(self, logits: mx.array) -> tuple[int, np.ndarray]:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        q = sampling_distribution(logprobs, self.options)[0]
        return int(self.rng.choice(q.shape[-1], p=q)), q

    def _chain(self, hidden: mx.array, token: mx.array, step: int) -> mx.array:
        embedding = self.target.embed_tokens(token.reshape(1, 1))
        position = self.slots + step - 1
        return self.target.step(embedding, hidden, self.cache, self.state, position, step)

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], np.ndarray | None]:
        self.drafts = []
        if k == 0 or self.last is None:
            return [], None
        self.offsets = [c.offset for c in self.cache]
        with mx.stream(generation_stream):
            hidden = self.last
            if self.greedy:
                # The whole chain as one graph, read once.
                tokens = [mx.argmax(self._logits(hidden), axis=-1)]
                for step in range(1, k):
                    hidden = self._chain(hidden, tokens[-1], step)
                    tokens.append(mx.argmax(self._logits(hidden), axis=-1))
                self.drafts = mx.concatenate(tokens).tolist()
                return self.drafts, None
            token, q = self._draw(self._logits(hidden))
            drafts, dists = [token], [q]
            for step in range(1, k):
                hidden = self._chain(hidden, mx.array([token]), step)
                token, q = self._draw(self._logits(hidden))
                drafts.append(token)
                dists.append(q)
        self.drafts = drafts
        return drafts, np.stack(dists)
