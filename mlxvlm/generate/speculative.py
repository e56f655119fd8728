"""Speculative decoding of one sequence: a drafter proposes up to K tokens, one target
pass over them (plus the last accepted token) judges all K at once, and the sequence
keeps the agreeing prefix and the target's own token after it.

Decoding reads every weight once per pass whether the pass holds one token or K + 1, so
each accepted draft saves most of a step where reading weights is the bound (a Mac, a
CPU). The prompt is prefilled as ``generate_tokens`` does, and its last chunk's pass gives
the first token, so a run starts exactly as the plain loop does.

What stays as without speculation:

- greedy: every emitted token is the target's argmax given the tokens before it
  (``acceptance.accept_greedy``), so the output is the plain loop's token for token
  (up to floating-point rounding between a one-token and a multi-token pass);
- sampling: the speculative-sampling rule (``acceptance.accept_sampled``) keeps the
  target's distribution; logits processors see, at each position, the tokens before it;
- the cache: rejected tokens are trimmed, or a cache that cannot be trimmed (recurrent or
  convolution states, a rotating cache that has wrapped) goes back to its state before
  the pass (``rewind.CacheCheckpoint``) and the tokens it keeps are fed again at the
  start of the next pass, which then drafts fewer tokens so that no pass exceeds K + 1;
- ``--max-kv-size``: a rotating cache that keeps attention sinks (``keep`` > 0) sees a
  multi-token pass past its window differently from one-token steps (mlx-lm's window
  mask drops the sinks for the later positions), so once such a window would overflow,
  decoding goes on one token per pass. Gemma 3's sliding-window caches keep no sinks and
  speculate throughout.

A grammar (``json_schema``) keeps a matcher that cannot step back, so it does not combine
with speculation; nor does a caller's own sampler, whose distribution is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.acceptance import accept_greedy, accept_sampled, is_greedy, sampling_distribution
from mlxvlm.generate.drafters import make_drafter
from mlxvlm.generate.loop import generation_stream, prefill_prompt
from mlxvlm.generate.mtp_drafter import MtpDrafter
from mlxvlm.generate.rewind import CacheCheckpoint
from mlxvlm.prompt import PreparedInputs
from mlxvlm.sampling import RowSampler, SamplingOptions, sampling_step, step_seed


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], np.ndarray | None]: ...

    def update(self, accepted: int, next_token: int) -> None: ...


@dataclass
class SpeculationStats:
    """How speculation went for one sequence (``--verbose``)."""

    drafted: int = 0  # tokens proposed
    accepted: int = 0  # of those, kept
    target_passes: int = 0  # decoding passes of the target (the prompt's not counted)
    decoded: int = 0  # tokens emitted by those passes
    # 1 once the draft model stopped drafting: the sequence holds an id its embedding
    # table lacks (``draft_vocab``); the sequence decodes plainly from there.
    stopped_drafting: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.decoded / self.target_passes if self.target_passes else 0.0

    def note(self, drafter: Any) -> None:
        """Count a drafter that stopped drafting (a draft model's ``stopped``)."""
        self.stopped_drafting = int(bool(getattr(drafter, "stopped", False)))

    def describe(self) -> str:
        stopped = ("; the draft model stopped drafting at a token its vocabulary lacks"
                   if self.stopped_drafting else "")
        return (f"{self.accepted}/{self.drafted} drafted tokens accepted "
                f"({100 * self.acceptance_rate:.1f}%), {self.tokens_per_pass:.2f} tokens "
                f"per target pass ({self.target_passes} passes){stopped}")


@dataclass(frozen=True)
class SpeculationOptions:
    """Speculative decoding for one ``generate`` call: a ``draft_model`` (a model, a
    ``(model, processor)`` pair as ``load`` returns, or a checkpoint path) drafting
    ``num_draft_tokens`` per pass, the checkpoint's own multi-token-prediction head
    (``mtp``, chained ``num_draft_tokens`` steps), or prompt lookup drafting
    ``prompt_lookup_num_tokens`` from the prompt's own n-grams; none set: no
    speculation."""

    draft_model: Any = None
    num_draft_tokens: int = 3
    prompt_lookup_num_tokens: int | None = None
    mtp: bool = False

    @property
    def enabled(self) -> bool:
        return (self.draft_model is not None or self.prompt_lookup_num_tokens is not None
                or self.mtp)

    @property
    def drafted(self) -> int:
        """Tokens drafted per pass."""
        if self.prompt_lookup_num_tokens is None:
            return self.num_draft_tokens
        return self.prompt_lookup_num_tokens

    def validate(self) -> None:
        chosen = [self.draft_model is not None, self.prompt_lookup_num_tokens is not None,
                  self.mtp]
        if sum(chosen) > 1:
            raise MlxvlmError("choose one drafter, not several: a draft model, prompt lookup "
                              "or the checkpoint's MTP head (--mtp)")


def check_speculation(options: SamplingOptions, sampler: Callable | None,
                      num_draft_tokens: int) -> None:
    if num_draft_tokens < 1:
        raise MlxvlmError(f"the number of draft tokens must be at least 1, got {num_draft_tokens}")
    if options.constraint is not None:
        raise MlxvlmError("speculative decoding does not combine with json_schema (a grammar's "
                          "matcher cannot step back over rejected drafts)")
    if sampler is not None:
        raise MlxvlmError("speculative decoding needs the built-in sampler (a custom sampler's "
                          "distribution is unknown to the acceptance rule)")


def _sink_window_full(cache: Sequence[Any], length: int) -> bool:
    """Whether a pass of ``length`` tokens would reach past a rotating window that keeps
    attention sinks (see the module's note on ``--max-kv-size``)."""
    return any(isinstance(c, RotatingKVCache) and c.keep > 0 and c.offset + length >= c.max_size
               for c in cache)


def speculative_tokens(
    model: nn.Module,
    inputs: PreparedInputs,
    *,
    cache: list[Any],
    prefill_step_size: int = 2048,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    **decoding: Any,
) -> Generator[tuple[int, mx.array], None, None]:
    """Yield ``(token, logprobs)`` as ``generate_tokens`` does: the prompt prefilled, its
    first token, then ``speculative_decode`` with ``decoding`` (its keywords: max_tokens,
    row, options, drafter, num_draft_tokens, stats, quantize)."""
    progress = prompt_progress_callback or (lambda *_: None)
    quantize = decoding.get("quantize") or (lambda _: None)
    drafter = decoding["drafter"]
    # The MTP head reads every pass's hidden states, the prompt's too.
    target = drafter.recording(model) if isinstance(drafter, MtpDrafter) else model
    input_ids = inputs.input_ids
    prompt = input_ids[0].tolist()
    total = input_ids.shape[1]
    embeddings, state, done = prefill_prompt(target, inputs, cache, prefill_step_size,
                                             quantize, progress)
    with mx.stream(generation_stream):
        logits = target(input_ids[:, done:], cache, embeddings=embeddings[:, done:], state=state,
                        last_only=True)
        quantize(cache)
        first, logprobs = sampling_step(logits[:, -1, :], [decoding["row"]], None)
        first = first.item()
    progress(total, total)
    yield first, logprobs.squeeze(0)
    yield from speculative_decode(model, cache, state, prompt, first, **decoding)


def speculative_decode(
    model: nn.Module,
    cache: list[Any],
    state: Any,
    prompt: list[int],
    first: int,
    *,
    max_tokens: int,
    row: RowSampler,
    options: SamplingOptions,
    drafter: Drafter,
    num_draft_tokens: int,
    stats: SpeculationStats,
    quantize: Callable[[list[Any]], None] | None = None,
    held: list[int] | None = None,
) -> Generator[tuple[int, mx.array], None, None]:
    """The tokens after ``first`` (the prompt's pass gave it; ``cache`` holds the prompt),
    up to ``max_tokens`` in all, as ``(token, logprobs)``. ``held``, if given, is extended
    with every token the target's cache takes in, in order (what a prefix cache keys the
    cache by: at times fewer than were emitted, and drafts accepted after a stop the
    caller acts on)."""
    quantize = quantize or (lambda _: None)
    if isinstance(drafter, MtpDrafter):
        model = drafter.recording(model)
    held = [] if held is None else held
    emitted = [first]
    drafter.update(0, first)
    stats.note(drafter)
    greedy = is_greedy(options)
    rng_seed = None if options.seed is None else step_seed(options.seed, 0)
    rng = np.random.default_rng(rng_seed)
    pending = [first]  # emitted tokens the target's cache does not hold yet
    while len(emitted) < max_tokens:
        # A pass of at most K + 1 tokens that emits at most what max_tokens leaves.
        room = min(num_draft_tokens + 1 - len(pending), max_tokens - len(emitted) - 1)
        if _sink_window_full(cache, len(pending) + max(room, 0)):
            room = 0
        drafts, q = drafter.propose(prompt + emitted, room) if room > 0 else ([], None)
        if len(pending) > 1 and not drafts and _sink_window_full(cache, len(pending)):
            # Feed all but the last pending token one at a time (as the plain loop would).
            with mx.stream(generation_stream):
                for token in pending[:-1]:
                    model(mx.array([[token]]), cache, state=state, last_only=True)
                    quantize(cache)
            held.extend(pending[:-1])
            pending = pending[-1:]
        feed = pending + drafts
        checkpoint = CacheCheckpoint(cache) if drafts else None
        with mx.stream(generation_stream):
            logits = model(mx.array([feed]), cache, state=state)
            quantize(cache)
            judged = logits[0, len(pending) - 1 :, :]
        target_logprobs, choice = judge(judged, row, prompt + emitted, drafts, options, greedy)
        if greedy:
            accepted, next_token = accept_greedy(choice, drafts)
        else:
            p = sampling_distribution(target_logprobs, options)
            accepted, next_token = accept_sampled(p, drafts, fit_draft(q, p.shape[-1]), rng)
        stats.drafted += len(drafts)
        stats.accepted += accepted
        stats.target_passes += 1
        stats.decoded += accepted + 1
        kept = len(pending) + accepted
        if checkpoint is None or checkpoint.rewind(cache, kept):
            held.extend(feed[:kept])
            pending = [next_token]
        else:
            pending = feed[:kept] + [next_token]
        drafter.update(accepted, next_token)
        stats.note(drafter)
        new_tokens = [*drafts[:accepted], next_token]
        for i, token in enumerate(new_tokens):
            emitted.append(token)
            yield token, target_logprobs[i]
            if len(emitted) >= max_tokens:
                break
        if stats.target_passes % 256 == 0:
            mx.clear_cache()


def judge(logits: mx.array, row: RowSampler, context: list[int], drafts: list[int],
           options: SamplingOptions, greedy: bool) -> tuple[mx.array, list[int] | None]:
    """The target's processed log-probabilities at each judged position (the one after
    the last accepted token, then one after each draft), with the row's logits
    processors seeing the tokens before each position; for greedy, each position's
    argmax too."""
    if row.processors:
        rows = []
        for i in range(logits.shape[0]):
            history = mx.array(context + drafts[:i])
            processed = logits[i : i + 1]
            for processor in row.processors:
                processed = processor(history, processed)
            rows.append(processed)
        logits = mx.concatenate(rows)
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    choice = mx.argmax(logprobs, axis=-1).tolist() if greedy else None
    mx.eval(logprobs)
    return logprobs, choice


def fit_draft(q: np.ndarray | None, vocab: int) -> np.ndarray | None:
    """A draft's distributions over the target's vocabulary (a draft's extra ids, which
    the target has none of, cannot be drawn from it anyway)."""
    if q is None or q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[:, :vocab]
    return np.pad(q, ((0, 0), (0, vocab - q.shape[-1])))


@dataclass(frozen=True)
class Speculation:
    """How the batching engine speculates (the server's ``--draft-model``,
    ``--prompt-lookup-num-tokens`` or ``--mtp``): ``draft_model`` is a loaded model that
    takes the target's prompt as it is (a quantized copy, a same-family model with the
    same processor) or an mlx-lm text model; ``mtp``: the model's own head, whose drafter
    watches the prompt's prefill (``watching_drafter``)."""

    draft_model: Any = None
    num_draft_tokens: int = 3
    prompt_lookup_num_tokens: int | None = None
    mtp: bool = False

    @property
    def num_tokens(self) -> int:
        if self.prompt_lookup_num_tokens is not None:
            return self.prompt_lookup_num_tokens
        return self.num_draft_tokens

    def usable(self, options: SamplingOptions) -> bool:
        """Whether a request can speculate (a grammar cannot)."""
        return options.constraint is None

    def watching_drafter(self, model: nn.Module, options: SamplingOptions, first_position: int,
                         prefill_step_size: int) -> MtpDrafter | None:
        """The drafter that must see the prompt's prefill (the MTP head's, from
        ``first_position``: after a reused prefix), made before it; None for the others."""
        if not self.mtp or not self.usable(options):
            return None
        seed = None if options.seed is None else step_seed(options.seed, -1)
        return MtpDrafter(model, options, first_position=first_position,
                          chunk=prefill_step_size, seed=seed)

    def drafter(self, model: nn.Module, inputs: PreparedInputs, options: SamplingOptions,
                prefill_step_size: int) -> Drafter:
        return make_drafter(model, inputs, options, draft_model=self.draft_model,
                            prompt_lookup=self.prompt_lookup_num_tokens is not None,
                            prepare_draft_inputs=None, prefill_step_size=prefill_step_size)
