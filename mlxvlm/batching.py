"""Continuous batching: one thread owns the model and decodes many requests together.

A request is prefilled on its own, exactly as ``mlxvlm.generate`` does it (its images
encoded by the family's ``embed``, its prompt run in chunks into a B=1 cache), then joins
the running decode batch: its cache becomes one row of mlx-lm's batched KV caches
(per-row offsets, left padding) and its position state one row of the family's
``batch_states``. Finished or cancelled requests leave the batch after the step that ends
them. Each request keeps its own sampler, logits processors, stop strings and token
budget. Between two decode steps the engine runs at most one prefill chunk, so a long
prompt delays the running requests by one chunk at a time.

With a ``PrefixCache``, a finished request's cache is kept, and a later prompt that
starts with the same tokens and images (the next turn of a conversation) continues from
it: the shared prefix is neither prefilled nor are its images encoded again.

``BatchEngine`` is the reusable core (the server runs it on a thread); ``batch_generate``
is the one-call Python API.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from mlxvlm.errors import MlxvlmError
from mlxvlm.generate import (
    GenerationOutput,
    SequenceText,
    embed_prompt,
    eos_token_ids,
    fit_to_context,
    generation_stream,
    prefill_chunks,
)
from mlxvlm.media import load_image
from mlxvlm.option_ranges import MAX_TOP_LOGPROBS  # noqa: F401  (its old home)
from mlxvlm.option_ranges import SAMPLING, at_least, check
from mlxvlm.sampling import build_sampler
from mlxvlm.sampling_defaults import checkpoint_defaults, invalid_sampling_value, resolve
from mlxvlm.prefix_cache import PrefixCache, prompt_key
from mlxvlm.prompt import PreparedInputs, build_messages, normalize_messages, prepare_inputs
from mlxvlm.tokenization import generation_tokenizer

logger = logging.getLogger(__name__)

@dataclass
class SamplingOptions:
    """How one request is sampled and when it stops (the defaults are greedy; callers
    that let a checkpoint's generation_config.json fill in values resolve them first,
    see ``mlxvlm.sampling_defaults``)."""

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

    def validate(self) -> None:
        """Every value within the ranges all entry points share (``mlxvlm.option_ranges``)."""
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

    def sampler(self) -> Callable[[mx.array], mx.array]:
        # Greedy requests all get mlx-lm's one greedy sampler, so a step samples them together.
        return build_sampler(self.temperature, self.top_p, self.top_k, self.min_p)

    def logits_processors(self) -> list[Callable]:
        return make_logits_processors(
            logit_bias=self.logit_bias,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


@dataclass
class BatchStep:
    """One generated token of one request, as delivered to its caller."""

    text: str  # new text (empty while a multi-byte character or stop string is pending)
    token: int
    finish_reason: str | None  # "stop" | "length" on the request's last step
    prompt_tokens: int
    cached_tokens: int  # prompt tokens reused from an earlier request's cache
    generation_tokens: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


Deliver = Callable[["BatchStep | BaseException"], None]


class EngineFault(RuntimeError):
    """The engine itself failed while running a request (a fault, not bad input); the
    exception it delivers in place of further steps. Errors that belong to one request's
    own input (raised while preparing or prefilling it) are delivered as they are."""


class SequenceHandle:
    """The caller's side of a submitted request."""

    def __init__(self, engine: "BatchEngine", request_id: int):
        self._engine = engine
        self.id = request_id
        self.cancelled = False

    def cancel(self) -> None:
        """Stop generating for this request; its batch slot is freed at the next step.
        Nothing more is delivered after the engine notices."""
        self.cancelled = True
        self._engine._wake()


@dataclass
class _Sequence:
    handle: SequenceHandle
    inputs: PreparedInputs
    options: SamplingOptions
    deliver: Deliver
    key: np.ndarray | None  # prefix-cache key of the prompt (None: no reuse)
    text: SequenceText
    sampler: Callable
    processors: list[Callable]
    submitted_at: float
    # Set while prefilling / decoding.
    cache: list[Any] | None = None
    state: Any = None
    embeddings: mx.array | None = None
    prefill: Any = None  # the prefill_chunks generator
    history: mx.array | None = None  # tokens the logits processors see
    cached_tokens: int = 0
    prefilled: int = 0  # prompt tokens after the cached ones already in the cache
    next_token: int = -1
    generated: list[int] = field(default_factory=list)

    @property
    def cancelled(self) -> bool:
        return self.handle.cancelled


@dataclass
class EngineStats:
    """Counters and gauges for monitoring (read from other threads without locking)."""

    waiting: int = 0
    active: int = 0  # prefilling or decoding
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_sum: float = 0.0
    time_to_first_token_count: int = 0
    decode_tokens_per_second: float = 0.0  # smoothed over recent decode steps
    peak_batch_size: int = 0  # the most requests decoded in one step so far


# What ``_emit`` reports about a request.
_RUNNING, _FINISHED, _CANCELLED = "running", "finished", "cancelled"


def _materialize(model: nn.Module) -> None:
    """Evaluate every array the model holds, parameters or not (e.g. rotary tables kept
    on plain helper objects), in the calling thread.

    MLX streams are per thread, and a lazy array can only be evaluated on the thread
    that built it; the engine's thread would fail on a table the loading thread left
    unevaluated. ``load`` evaluates the parameters, not such helpers.
    """
    arrays: list[mx.array] = []
    seen: set[int] = set()

    def collect(value: Any, depth: int) -> None:
        if id(value) in seen or depth > 4:
            return
        seen.add(id(value))
        if isinstance(value, mx.array):
            arrays.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module)):
            for item in vars(value).values():
                collect(item, depth + 1)

    for module in model.modules():
        for value in vars(module).values():
            collect(value, 0)
    mx.eval(model.parameters(), arrays)


def _step_seed(seed: int, step: int) -> int:
    """A seed per (request seed, token index): a seeded request samples the same tokens
    whatever else shares its batch."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class BatchEngine:
    """Runs submitted requests through one model with continuous batching.

    ``submit`` may be called from any thread; the model is only touched by whoever calls
    ``step`` (the engine's own thread after ``start``). Results reach each request's
    ``deliver`` callback on that thread: a ``BatchStep`` per token, the last one with a
    ``finish_reason``, or one exception if the request failed.
    """

    def __init__(
        self,
        model: nn.Module,
        processor: Any,
        *,
        max_batch_size: int = 8,
        prefill_step_size: int = 2048,
        prefix_cache: PrefixCache | None = None,
    ):
        if max_batch_size < 1:
            raise MlxvlmError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.model = model
        self.processor = processor
        self.tokenizer = generation_tokenizer(processor)
        self.eos_token_ids = eos_token_ids(processor)
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self.prefix_cache = prefix_cache
        self.placeholders = np.fromiter(model.placeholder_token_ids, dtype=np.int64)
        self.stats = EngineStats()
        _materialize(model)

        self._waiting: deque[_Sequence] = deque()
        self._prefilling: _Sequence | None = None
        self._active: list[_Sequence] = []  # one per row of the batch cache
        self._batch_cache: list[Any] | None = None
        self._batch_state: Any = None
        self._next_id = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- the caller's side -----------------------------------------------------------

    def submit(
        self,
        inputs: PreparedInputs,
        options: SamplingOptions,
        deliver: Deliver,
        *,
        image_hashes: Sequence[str] | None = (),
        cache_namespace: str | None = None,
    ) -> SequenceHandle:
        """Queue a prepared prompt. Raises ``MlxvlmError`` (e.g. ``PromptTooLongError``)
        at once for options or prompts that cannot run. ``image_hashes`` (see
        ``prefix_cache.image_hash``), in prompt order, let the prompt reuse a cache; None
        keeps it out of the prefix cache (e.g. media the keys cannot describe). Prompts
        share cached prefixes only within one ``cache_namespace`` (the server's API key)."""
        options.validate()
        max_tokens = fit_to_context(self.model, inputs.num_tokens, options.max_tokens)
        key = None
        if self.prefix_cache is not None and image_hashes is not None:
            key = prompt_key(np.asarray(inputs.input_ids[0]), self.placeholders, image_hashes,
                             namespace=cache_namespace)
        with self._cond:
            if self._closed:
                raise MlxvlmError("the engine is shut down")
            handle = SequenceHandle(self, self._next_id)
            self._next_id += 1
            self._waiting.append(
                _Sequence(
                    handle=handle,
                    inputs=inputs,
                    options=options,
                    deliver=deliver,
                    key=key,
                    text=SequenceText(self.tokenizer, self.eos_token_ids, options.stop, max_tokens),
                    sampler=options.sampler(),
                    processors=options.logits_processors(),
                    submitted_at=time.perf_counter(),
                )
            )
            self.stats.waiting = len(self._waiting)
            self._cond.notify()
        return handle

    def start(self) -> None:
        """Run the engine on its own thread until ``close``."""
        self._thread = threading.Thread(target=self._run, name="mlxvlm-engine", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        error = MlxvlmError("the engine is shutting down")
        for seq in self._drain():
            self._deliver(seq, error)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._active)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self.has_work:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception as e:  # never leave callers waiting on a dead thread
                logger.exception("the batching engine failed; failing its requests")
                failure = EngineFault(f"the engine failed ({type(e).__name__}: {e})")
                failure.__cause__ = e
                for seq in self._drain():
                    self._fail(seq, failure)

    def _drain(self) -> list[_Sequence]:
        with self._cond:
            pending = list(self._waiting)
            self._waiting.clear()
        if self._prefilling is not None:
            pending.append(self._prefilling)
            self._prefilling = None
        pending.extend(self._active)
        self._active = []
        self._batch_cache = None
        self._update_gauges()
        return pending

    # -- one iteration -------------------------------------------------------------

    def step(self) -> None:
        """Admit the next waiting request, run one prefill chunk, run one decode step."""
        self._drop_cancelled_waiting()
        self._drop_cancelled_active()
        if (
            self._prefilling is None
            and self._waiting
            and len(self._active) < self.max_batch_size
        ):
            with self._cond:
                seq = self._waiting.popleft()
            self._guard(seq, self._start_prefill)
        if self._prefilling is not None:
            self._guard(self._prefilling, self._advance_prefill)
        if self._active:
            try:
                self._decode_step()
            except Exception as e:  # a fault in the batch fails its requests, not the engine
                logger.exception("a decode step failed; failing the requests in the batch")
                failure = EngineFault(f"the decode step failed ({type(e).__name__}: {e})")
                failure.__cause__ = e
                for seq in self._active:
                    self._fail(seq, failure)
                self._active, self._batch_cache, self._batch_state = [], None, None
        self._update_gauges()

    def _guard(self, seq: _Sequence, action: Callable[[_Sequence], None]) -> None:
        try:
            action(seq)
        except Exception as e:
            if self._prefilling is seq:
                self._prefilling = None
            self._fail(seq, e)

    def _fail(self, seq: _Sequence, error: BaseException) -> None:
        self.stats.requests_failed += 1
        self._deliver(seq, error)

    def _deliver(self, seq: _Sequence, item: "BatchStep | BaseException") -> None:
        try:
            seq.deliver(item)
        except Exception:  # a broken consumer must not stop the engine
            seq.handle.cancelled = True

    def _drop_cancelled_waiting(self) -> None:
        with self._cond:
            kept = deque(s for s in self._waiting if not s.cancelled)
            self.stats.requests_cancelled += len(self._waiting) - len(kept)
            self._waiting = kept

    def _drop_cancelled_active(self) -> None:
        """Free the batch rows of cancelled requests before anything else this step, so
        that a waiting request can take a slot at once."""
        keep = [i for i, seq in enumerate(self._active) if not seq.cancelled]
        if len(keep) < len(self._active):
            self.stats.requests_cancelled += len(self._active) - len(keep)
            self._keep_rows(keep)

    def _keep_rows(self, keep: list[int]) -> None:
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._batch_cache, self._batch_state = None, None
            return
        for layer in self._batch_cache:
            layer.filter(keep)
        self._batch_state = self.model.batch_states([s.state for s in self._active])

    def _update_gauges(self) -> None:
        self.stats.waiting = len(self._waiting)
        self.stats.active = len(self._active) + (self._prefilling is not None)

    # -- prefill --------------------------------------------------------------------

    def _start_prefill(self, seq: _Sequence) -> None:
        """Encode the prompt (reusing a cached prefix when one matches) and set up the
        chunked prefill of the rest."""
        model, ids = self.model, seq.inputs.input_ids
        hit = self.prefix_cache.lookup(seq.key) if seq.key is not None else None
        state = None
        if hit is not None:
            try:  # the family may refuse a prefix (e.g. one ending inside a bidirectional span)
                state = model.prefix_state(hit.state, hit.length)
            except NotImplementedError:
                hit = None
        start = hit.length if hit is not None else 0
        text_follows = hit is not None and not np.isin(np.asarray(ids[0, start:]), self.placeholders).any()
        if text_follows:
            # Only text follows the reused prefix: no image is encoded again.
            embeddings, _ = embed_prompt(model, ids[:, start:])
        else:
            embeddings, state = embed_prompt(model, ids, **seq.inputs.features)
            embeddings = embeddings[:, start:]
        seq.cache = hit.cache if hit is not None else model.make_cache()
        seq.state, seq.embeddings, seq.cached_tokens = state, embeddings, start
        seq.history = ids[0] if seq.processors else None
        seq.prefill = prefill_chunks(
            model,
            ids[:, start:],
            embeddings,
            state,
            seq.cache,
            prefill_step_size=self.prefill_step_size,
        )
        self.stats.prompt_tokens += seq.inputs.num_tokens
        self.stats.cached_prompt_tokens += start
        self._prefilling = seq

    def _advance_prefill(self, seq: _Sequence) -> None:
        if seq.cancelled:
            self._prefilling = None
            self.stats.requests_cancelled += 1
            return
        done = next(seq.prefill, None)
        if done is not None:
            seq.prefilled = done
            return
        # The rest of the prompt (its final chunk) gives the first new token in the same
        # pass, as in generate_tokens.
        self._prefilling = None
        rest = seq.cached_tokens + seq.prefilled
        with mx.stream(generation_stream):
            logits = self.model(
                seq.inputs.input_ids[:, rest:],
                seq.cache,
                embeddings=seq.embeddings[:, seq.prefilled :],
                state=seq.state,
                last_only=True,
            )[:, -1, :]
            for processor in seq.processors:
                logits = processor(seq.history, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            tokens = self._sample([seq], logprobs)
            mx.eval(tokens, logprobs)
        seq.embeddings = None
        now = time.perf_counter()
        self.stats.time_to_first_token_sum += now - seq.submitted_at
        self.stats.time_to_first_token_count += 1
        outcome = self._emit(seq, tokens.item(), self._logprobs_rows([seq], logprobs)[0])
        if outcome is _RUNNING:
            self._join(seq)
        elif outcome is _FINISHED:
            self._finished(seq, cache=seq.cache)
        else:
            self.stats.requests_cancelled += 1

    def _join(self, seq: _Sequence) -> None:
        """Add the prefilled request as a new row of the decode batch."""
        row = []
        for layer_cache in seq.cache:
            if not hasattr(layer_cache, "merge"):
                raise MlxvlmError(
                    f"{type(layer_cache).__name__} caches cannot be batched; "
                    "serve this model with --max-concurrency 1"
                )
            row.append(layer_cache.merge([layer_cache]))
        if self._batch_cache is None:
            self._batch_cache = row
        else:
            for batch_layer, row_layer in zip(self._batch_cache, row):
                batch_layer.extend(row_layer)
        seq.cache = None
        self._active.append(seq)
        self._batch_state = self.model.batch_states([s.state for s in self._active])

    # -- decode ---------------------------------------------------------------------

    def _sample(self, rows: list[_Sequence], logprobs: mx.array) -> mx.array:
        """One token per row, each with its own sampler; unseeded rows that share a
        sampler (all greedy ones) are sampled in one call."""
        groups: dict[int, list[int]] = {}
        singles = []
        for i, seq in enumerate(rows):
            if seq.options.seed is None:
                groups.setdefault(id(seq.sampler), []).append(i)
            else:
                singles.append(i)
        if len(groups) == 1 and not singles:
            return rows[0].sampler(logprobs)
        order, parts = [], []
        for indices in groups.values():
            order.extend(indices)
            parts.append(rows[indices[0]].sampler(logprobs[mx.array(indices)]))
        for i in singles:
            seq = rows[i]
            mx.random.seed(_step_seed(seq.options.seed, len(seq.generated)))
            order.append(i)
            parts.append(seq.sampler(logprobs[i : i + 1]))
        tokens = mx.concatenate(parts)
        return tokens[mx.array(np.argsort(order))]

    def _decode_step(self) -> None:
        rows = self._active
        started = time.perf_counter()
        self.stats.peak_batch_size = max(self.stats.peak_batch_size, len(rows))
        inputs = mx.array([[seq.next_token] for seq in rows], dtype=mx.int32)
        with mx.stream(generation_stream):
            logits = self.model(inputs, self._batch_cache, state=self._batch_state)[:, -1, :]
            if any(seq.processors for seq in rows):
                processed = []
                for i, seq in enumerate(rows):
                    row_logits = logits[i : i + 1]
                    if seq.processors:
                        seq.history = mx.concatenate([seq.history, inputs[i]])
                        for processor in seq.processors:
                            row_logits = processor(seq.history, row_logits)
                    processed.append(row_logits)
                logits = mx.concatenate(processed)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            tokens = self._sample(rows, logprobs)
            mx.eval(tokens, logprobs)
        tokens = tokens.tolist()
        rows_logprobs = self._logprobs_rows(rows, logprobs)

        keep = []
        for i, seq in enumerate(rows):
            outcome = self._emit(seq, tokens[i], rows_logprobs[i])
            if outcome is _RUNNING:
                keep.append(i)
            elif outcome is _CANCELLED:
                self.stats.requests_cancelled += 1
            else:
                cache = None
                if self.prefix_cache is not None and seq.key is not None:
                    cache = [layer.extract(i) for layer in self._batch_cache]
                self._finished(seq, cache=cache)
        self._update_throughput(len(rows), time.perf_counter() - started)
        if len(keep) < len(rows):
            self._keep_rows(keep)

    @staticmethod
    def _logprobs_rows(rows: list[_Sequence], logprobs: mx.array) -> list[np.ndarray | None]:
        """Each row's log-probabilities as numpy, for the rows that asked for them (one
        copy of the whole batch rather than one MLX op per row)."""
        if all(seq.options.top_logprobs is None for seq in rows):
            return [None] * len(rows)
        values = np.asarray(logprobs.astype(mx.float32))
        return [values[i] if seq.options.top_logprobs is not None else None
                for i, seq in enumerate(rows)]

    def _emit(self, seq: _Sequence, token: int, logprobs: np.ndarray | None) -> str:
        """Deliver one token; whether the request goes on, finished or was cancelled."""
        if seq.cancelled:
            return _CANCELLED
        seq.generated.append(token)
        seq.next_token = token
        segment, finish_reason = seq.text.add(token)
        step = BatchStep(
            text=segment,
            token=token,
            finish_reason=finish_reason,
            prompt_tokens=seq.inputs.num_tokens,
            cached_tokens=seq.cached_tokens,
            generation_tokens=len(seq.generated),
        )
        k = seq.options.top_logprobs
        if k is not None:
            values = logprobs
            step.logprob = float(values[token])
            if k:
                top = np.argpartition(-values, k - 1)[:k]
                top = top[np.argsort(-values[top], kind="stable")]
                step.top_logprobs = [(int(t), float(values[t])) for t in top]
        self.stats.generated_tokens += 1
        self._deliver(seq, step)
        if finish_reason is not None:
            # Decided here: the caller may cancel as soon as it has the last step.
            return _FINISHED
        return _CANCELLED if seq.cancelled else _RUNNING

    def _finished(self, seq: _Sequence, cache: list[Any] | None) -> None:
        self.stats.requests_finished += 1
        if cache is not None and self.prefix_cache is not None and seq.key is not None:
            # The cache holds the prompt and every generated token but the last (which
            # was sampled, never fed back).
            key = np.concatenate([seq.key, np.asarray(seq.generated[:-1], dtype=np.int64)])
            self.prefix_cache.insert(key, cache, seq.state)

    def _update_throughput(self, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate = tokens / seconds
        previous = self.stats.decode_tokens_per_second
        self.stats.decode_tokens_per_second = rate if previous == 0 else 0.9 * previous + 0.1 * rate


def batch_generate(
    model: nn.Module,
    processor: Any,
    prompts: Sequence[str | Sequence[dict]],
    images: Sequence[Any] | None = None,
    *,
    max_batch_size: int = 8,
    prefill_step_size: int = 2048,
    system: str | None = None,
    media_options: dict | None = None,
    **sampling: Any,
) -> list[GenerationOutput]:
    """Generate answers for many prompts at once with continuous batching.

    ``prompts`` are strings or chat messages (as for ``generate``); ``images`` gives each
    prompt its image(s) (None, one source, or a list). The sampling keywords are
    ``SamplingOptions``' (``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``repetition_penalty``, ``seed``, ``stop`` ...) and apply to every prompt;
    the ones left out (or None) come from the checkpoint's generation_config.json, as for
    ``generate``. Greedy answers equal ``generate``'s for the same prompt. Returns one
    ``GenerationOutput`` per prompt, in order.
    """
    if images is not None and len(images) != len(prompts):
        raise MlxvlmError(f"got {len(prompts)} prompts but {len(images)} image entries")
    unknown = sorted(set(sampling) - set(SamplingOptions.__dataclass_fields__))
    if unknown:
        raise MlxvlmError(f"batch_generate got unknown sampling options: {', '.join(unknown)}")
    chosen = resolve(sampling, checkpoint_defaults(processor)).values
    options = SamplingOptions(**{**sampling, **chosen})
    options.validate()
    engine = BatchEngine(
        model, processor, max_batch_size=max_batch_size, prefill_step_size=prefill_step_size
    )
    outputs = [GenerationOutput(text="") for _ in prompts]
    pieces: list[list[str]] = [[] for _ in prompts]
    errors: list[BaseException] = []
    started = time.perf_counter()

    def collect(index: int) -> Deliver:
        def deliver(item: BatchStep | BaseException) -> None:
            if isinstance(item, BaseException):
                errors.append(item)
                return
            output = outputs[index]
            pieces[index].append(item.text)
            output.tokens.append(item.token)
            output.prompt_tokens = item.prompt_tokens
            output.generation_tokens = item.generation_tokens
            output.finish_reason = item.finish_reason

        return deliver

    for index, prompt in enumerate(prompts):
        extra = images[index] if images is not None else None
        sources = extra if isinstance(extra, (list, tuple)) else ([] if extra is None else [extra])
        messages = build_messages(prompt, len(sources), system)
        messages, sources = normalize_messages(messages, sources)
        loaded = [load_image(source, **(media_options or {})) for source in sources]
        inputs = prepare_inputs(
            processor, messages, loaded, feature_names=getattr(model, "feature_names", None)
        )
        engine.submit(inputs, options, collect(index))
    while engine.has_work and not errors:
        engine.step()
    if errors:
        raise errors[0]
    elapsed = time.perf_counter() - started
    total = sum(o.generation_tokens for o in outputs)
    for output, text in zip(outputs, pieces):
        output.text = "".join(text)
        output.generation_tps = total / elapsed if elapsed > 0 else 0.0
        output.peak_memory = mx.get_peak_memory() / 1e9
    return outputs
