"""Sampling, one way for every path (``generate``, the batching engine and so the server
and the UI): the options (``SamplingOptions``, validated once), the sampler built from
them (mlx-lm's samplers, guarded against values that would make them fail or sample
noise) and the sampling step itself (``sampling_step``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlxvlm.cpu.ops import logsumexp_last
from mlxvlm.errors import MlxvlmError
from mlxvlm.sampling.ranges import SAMPLING, at_least, check
from mlxvlm.sampling.defaults import invalid_sampling_value

Sampler = Callable[[mx.array], mx.array]

# Below this temperature sampling is greedy (vLLM's threshold, _SAMPLING_EPS): mlx-lm
# scales the log-probabilities by 1/T, which for a tiny T overflows float32 to -inf
# everywhere and samples uniformly from garbage; the limit of T -> 0 is the argmax.
GREEDY_BELOW = 1e-5
_GREEDY = make_sampler(temp=0.0)  # mlx-lm returns this one function for every greedy call


def build_sampler(temperature: float, top_p: float = 1.0, top_k: int = 0,
                  min_p: float = 0.0) -> Sampler:
    if temperature < GREEDY_BELOW:
        # mlx-lm's one greedy sampler: the batching engine samples rows sharing it together.
        return _GREEDY
    if top_k <= 0:
        return make_sampler(temp=temperature, top_p=top_p, min_p=min_p)
    return _VocabularyBoundTopK(temperature, top_p, top_k, min_p)


class _VocabularyBoundTopK:
    """Top-k with k bounded by the vocabulary, known only once logits arrive: k at or
    above the vocabulary keeps every token (mlx-lm refuses such a k)."""

    def __init__(self, temperature: float, top_p: float, top_k: int, min_p: float):
        self.options = dict(temp=temperature, top_p=top_p, min_p=min_p)
        self.top_k = top_k
        self._by_width: dict[int, Sampler] = {}

    def __call__(self, logprobs: mx.array) -> mx.array:
        width = logprobs.shape[-1]
        sampler = self._by_width.get(width)
        if sampler is None:
            top_k = self.top_k if self.top_k < width else 0
            sampler = self._by_width[width] = make_sampler(top_k=top_k, **self.options)
        return sampler(logprobs)


@dataclass
class SamplingOptions:
    """How one sequence is sampled and when it stops, for every path (``generate``, the
    batching engine, the server, the UI). The defaults are greedy; callers that let a
    checkpoint's generation_config.json fill in values resolve them first (see
    ``mlxvlm.sampling.defaults``). Penalties and ``logit_bias`` have OpenAI's meaning."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    # None: no log-probabilities; k >= 0: the chosen token's plus the k most likely.
    top_logprobs: int | None = None
    # A grammar the answer must follow (mlxvlm.sampling.constrained.GrammarConstraint).
    constraint: Any = None
    # More per-sequence logits processors, each made by ``.processor(max_tokens)`` as
    # the grammar's is (e.g. the server's thinking budget); they run before the grammar.
    extra_processors: tuple = ()
    # Special tokens whose text the answer keeps (decode drops the others), e.g. Gemma 4's
    # thinking markers, for the server to split the thoughts from the answer.
    kept_token_ids: frozenset = frozenset()

    def validate(self) -> None:
        """Every value within the ranges all entry points share (``mlxvlm.sampling.ranges``)."""
        names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "repetition_context_size", "presence_penalty", "frequency_penalty", "seed",
                 "top_logprobs")
        problem = invalid_sampling_value({name: getattr(self, name) for name in names})
        if problem is None and self.logit_bias:
            bias_range = SAMPLING["logit_bias_value"]
            for token, bias in self.logit_bias.items():
                problem = check("logit_bias token", token, at_least(0)) or check(
                    "logit_bias value", bias, bias_range)
                if problem:
                    break
        if problem is not None:
            raise MlxvlmError(problem)

    def sampler(self) -> Sampler:
        # Greedy options all get mlx-lm's one greedy sampler, so a step samples them together.
        return build_sampler(self.temperature, self.top_p, self.top_k, self.min_p)

    def logits_processors(self) -> list[Callable]:
        """A fresh list per sequence (a grammar's processor holds that sequence's state);
        the grammar comes last, so that no other processor can lift its mask."""
        processors = make_logits_processors(
            logit_bias=self.logit_bias,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        processors += [extra.processor(self.max_tokens) for extra in self.extra_processors]
        if self.constraint is not None:
            processors.append(self.constraint.processor(self.max_tokens))
        return processors


def step_seed(seed: int, step: int, stage: str = "") -> int:
    """A seed per (sequence seed, token index): a seeded sequence samples the same tokens
    alone or in any batch, through ``generate`` or the server. ``stage``: another model
    drawing from the same request's seed (a talker), apart from the text's draws."""
    key = f"{seed}:{step}" if not stage else f"{seed}:{stage}:{step}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class RowSampler:
    """One sequence's side of ``sampling_step``: its sampler, its logits processors and
    the tokens they see (the prompt, then every token fed back), and how many tokens it
    has sampled (the index its seed is drawn for)."""

    def __init__(self, options: SamplingOptions, prompt_ids: mx.array, *,
                 sampler: Sampler | None = None, processors: Sequence[Callable] | None = None):
        self.seed = options.seed
        self.sampler = sampler if sampler is not None else options.sampler()
        if processors is None:
            self.processors = options.logits_processors()
        else:  # the caller's own, and the grammar still last
            self.processors = list(processors)
            self.processors += [extra.processor(options.max_tokens)
                                for extra in options.extra_processors]
            if options.constraint is not None:
                self.processors.append(options.constraint.processor(options.max_tokens))
        self.history = prompt_ids if self.processors else None
        if self.history is not None:
            # Evaluated here, in the thread that built it: MLX streams are per thread, and
            # the batching engine's thread could not evaluate another thread's lazy slice.
            mx.eval(self.history)
        self.sampled = 0
        # What ended this sequence alone in a batched step (see ``sampling_step``).
        self.failure: Exception | None = None

    @property
    def shares_sampler(self) -> bool:
        # The greedy sampler draws nothing, so a seed does not set it apart.
        return self.seed is None or self.sampler is _GREEDY


def sampling_step(
    logits: mx.array, rows: Sequence[RowSampler], fed: mx.array | None = None, *,
    isolate: bool = False,
) -> tuple[mx.array, mx.array]:
    """The one sampling step of every path: last-position ``logits`` (one row per
    sequence) through each row's processors, normalized to log-probabilities, one token
    sampled per row. ``fed``: the token each row was just fed (its processors see it),
    None for a prompt's last chunk. Returns ``(tokens, logprobs)``, lazily.

    ``isolate`` (a batch of several requests): a row whose processors raise (its grammar
    fails, say) keeps the error in ``row.failure`` and is sampled from its bare logits,
    a token its caller must not deliver; the other rows are not touched. Without it the
    error is raised."""
    if any(row.processors for row in rows):
        parts = []
        for i, row in enumerate(rows):
            bare = logits if len(rows) == 1 else logits[i : i + 1]
            row_logits = bare
            if row.processors:
                if fed is not None:
                    row.history = mx.concatenate([row.history, fed[i : i + 1]])
                if row.failure is None:
                    try:
                        for processor in row.processors:
                            row_logits = processor(row.history, row_logits)
                    except Exception as error:
                        if not isolate:
                            raise
                        row.failure, row_logits = error, bare
            parts.append(row_logits)
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    logprobs = logits - logsumexp_last(logits)
    tokens = _sample_rows(rows, logprobs)
    for row in rows:
        row.sampled += 1
    return tokens, logprobs


def sampled_sanely(tokens: mx.array, logprobs: mx.array) -> mx.array:
    """Per row, lazily: whether its token was drawn from a real distribution (a finite
    log-probability). False where the row's scores held a NaN, or where its processors
    between them allowed no token at all (the sampler then picks an arbitrary one)."""
    chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)
    return mx.isfinite(chosen.reshape(-1))


def _sample_rows(rows: Sequence[RowSampler], logprobs: mx.array) -> mx.array:
    """One token per row, each with its own sampler; rows that share a sampler and no
    seed (all greedy ones) are sampled in one call."""
    groups: dict[int, list[int]] = {}
    singles = []
    for i, row in enumerate(rows):
        if row.shares_sampler:
            groups.setdefault(id(row.sampler), []).append(i)
        else:
            singles.append(i)
    if len(groups) == 1 and not singles:
        return rows[0].sampler(logprobs)
    if len(rows) == 1:  # one seeded row
        mx.random.seed(step_seed(rows[0].seed, rows[0].sampled))
        return rows[0].sampler(logprobs)
    order, parts = [], []
    for indices in groups.values():
        order.extend(indices)
        parts.append(rows[indices[0]].sampler(logprobs[mx.array(indices)]))
    for i in singles:
        row = rows[i]
        mx.random.seed(step_seed(row.seed, row.sampled))
        order.append(i)
        parts.append(row.sampler(logprobs[i : i + 1]))
    tokens = mx.concatenate(parts)
    return tokens[mx.array(np.argsort(order))]


def token_logprobs(
    values: np.ndarray, token: int, k: int
) -> tuple[float, list[tuple[int, float]] | None]:
    """The chosen token's log-probability and, for ``k`` > 0, the ``k`` most likely tokens
    with theirs (most likely first, ties by token id), as OpenAI's logprobs report them."""
    logprob = float(values[token])
    if not k:
        return logprob, None
    top = np.argpartition(-values, k - 1)[:k]
    top = top[np.argsort(-values[top], kind="stable")]
    return logprob, [(int(t), float(values[t])) for t in top]
