"""Continuous batching: one thread owns the model and decodes many requests together.

A request is prefilled on its own, exactly as ``mlxvlm.generate`` does it (its images
encoded by the family's ``embed``, its prompt run in chunks into a B=1 cache), then joins
the running decode batch: its cache becomes one row of mlx-lm's batched KV caches
(per-row offsets, left padding) and its position state one row of the family's
``batch_states`` (see ``DecodeBatch``). Finished or cancelled requests leave the batch
after the step that ends them. Each request keeps its own sampler, logits processors,
stop strings and token budget; every token is sampled by the same ``sampling_step`` as
``generate``'s. Between two decode steps the engine runs at most one prefill chunk, so a long
prompt delays the running requests by one chunk at a time.

A failure of one request's own -- its logits processors raising (a grammar the parser
gives up on), its scores turning to NaN or ruling out every token -- ends that request
alone (``SequenceFault`` or the processor's error), at its prefill or at the decode step
it happens in; the others in the batch go on as if it had never been there. Only a
fault of the step itself fails the whole batch.

With a ``PrefixCache``, a finished request's cache is kept, and a later prompt that
starts with the same tokens and images (the next turn of a conversation) continues from
it: the shared prefix is neither prefilled nor are its images encoded again.

A spoken request (``submit(speech=)``, a model with a talker) is a row like the others;
its talker follows its thinker token by token, every talker that can take a frame takes
one per iteration, and its audio is delivered between its steps (``spoken_rows``). Its
prefix-cache entry carries what its tap recorded (its talker reads the whole prompt's
thinker states), so a later spoken turn reuses it and records only its new positions; a
spoken turn after a text turn prefills whole. It never speculates; its speaker's failure
ends it alone, and a fault of the talkers' step fails the spoken requests, not the text
rows.

``BatchEngine`` is the reusable core (the server runs it on a thread);
``mlxvlm.batching.api.batch_generate`` is the one-call Python API.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.batching.decode import DecodeBatch
from mlxvlm.batching.row_rewind import rewindable
from mlxvlm.batching.speculation_rule import SpeculationRule
from mlxvlm.batching.speculative_batch import SpeculativeBatch
from mlxvlm.batching.engine_thread import EngineThread
from mlxvlm.batching.spoken_rows import BatchAudio, SpokenRows
from mlxvlm.models.base import materialize
from mlxvlm.errors import MlxvlmError, bounded
from mlxvlm.generate.cache import DEFAULT_QUANTIZED_KV_START, CacheOptions
from mlxvlm.generate.loop import embed_prompt, fit_to_context, generation_stream, prefill_chunks
from mlxvlm.generate.speculative import Speculation, SpeculationStats, speculative_decode
from mlxvlm.generate.speech import SpeechRequest, check_speech_request
from mlxvlm.generate.state_cache import StateSnapshots, is_state_cache, turn_boundaries
from mlxvlm.generate.text import SequenceText, eos_token_ids
from mlxvlm.batching.prefix_cache import PrefixCache, prompt_key
from mlxvlm.prompt import PreparedInputs
from mlxvlm.sampling import (RowSampler, SamplingOptions, sampled_sanely, sampling_step,
                             token_logprobs)
from mlxvlm.text.tokenization import generation_tokenizer

logger = logging.getLogger(__name__)


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
    stop_string: str | None = None  # on the last step: the stop string that ended it


# A request's items: its steps (and a spoken request's audio between them), or one exception.
Deliver = Callable[["BatchStep | BatchAudio | BaseException"], None]


class EngineFault(RuntimeError):
    """The engine itself failed while running a request (a fault, not bad input); the
    exception it delivers in place of further steps. Errors that belong to one request's
    own input (raised while preparing or prefilling it) are delivered as they are."""


class SequenceFault(EngineFault):
    """One sequence's own step went wrong (its scores held a NaN, or its logits
    processors between them allowed no token): it ends alone, the others go on."""


def _fault_of(error: Exception, what: str) -> EngineFault:
    """``error`` as the fault callers see, its message bounded (a parser's message can
    carry its whole grammar)."""
    fault = EngineFault(f"{what} ({type(error).__name__}: {bounded(str(error))})")
    fault.__cause__ = error
    return fault


def _log_failure(error: BaseException, what: str) -> None:
    """A bounded line for a request's own mistake; for a fault, the traceback too, but
    the message still bounded."""
    if isinstance(error, MlxvlmError):
        logger.info("%s: %s", what, bounded(str(error)))
        return
    trace = "".join(traceback.format_tb(error.__traceback__))
    logger.error("%s: %s: %s\n%s", what, type(error).__name__, bounded(str(error)), trace)


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
    row: RowSampler  # its sampler, processors and the tokens they see
    submitted_at: float
    # Set while prefilling / decoding.
    cache: list[Any] | None = None  # while prefilling (then a row of the DecodeBatch)
    state: Any = None
    embeddings: mx.array | None = None
    prefill: Any = None  # the prefill_chunks generator
    cached_tokens: int = 0
    prefilled: int = 0  # prompt tokens after the cached ones already in the cache
    generated: list[int] = field(default_factory=list)  # delivered tokens
    # Its state layers' states where a later prompt may resume (see generate.state_cache).
    snapshots: StateSnapshots = field(default_factory=StateSnapshots)
    speculative: Any = None  # the speculative_decode generator, while it speculates
    held: list[int] | None = None  # the tokens its cache took in after the prompt
    namespace: str | None = None  # its API key's (a prefix-cache file must carry it)
    # A drafter that watches the prefill (the MTP head's), made with it; else None.
    drafter: Any = None
    speculation_stats: SpeculationStats | None = None
    # A spoken request's: what to say, and the tap recording its thinker states.
    speech: SpeechRequest | None = None
    tap: Any = None
    # what its tap held once its text was written (its prefix-cache entry's records)
    tap_records: Any = None
    written: bool = False  # its text is complete
    failed: bool = False  # its failure is delivered (a speaker's may come between steps)

    @property
    def cancelled(self) -> bool:
        return self.handle.cancelled


@dataclass
class EngineStats:
    """Counters and gauges for monitoring (read from other threads without locking)."""

    waiting: int = 0
    active: int = 0  # prefilling, decoding, or (its text written) still speaking
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
    # Speculative decoding, over the requests that finished speculating.
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    # requests whose draft model stopped drafting at an id its embedding table lacks
    stopped_drafts: int = 0


# What ``_emit`` reports about a request (_FAILED: its failure is delivered).
_RUNNING, _FINISHED, _CANCELLED, _FAILED = "running", "finished", "cancelled", "failed"


class BatchEngine(EngineThread):
    """Runs submitted requests through one model with continuous batching.

    ``submit`` may be called from any thread; the model is only touched by whoever calls
    ``step`` (the engine's own thread after ``start``). Results reach each request's
    ``deliver`` callback on that thread: a ``BatchStep`` per token, the last one with a
    ``finish_reason`` (a spoken request's ``BatchAudio`` items among them, then its last
    one, with its whole speech), or one exception if the request failed.
    """

    # The sharded server's engine (``sharded_engine``) runs a sharded model: its model
    # carries every pass to the other ranks, and its batch tells them of joins and leaves.
    carries_passes_to_ranks = False
    decode_batch_class = DecodeBatch

    def __init__(
        self,
        model: nn.Module,
        processor: Any,
        *,
        max_batch_size: int = 8,
        prefill_step_size: int = 2048,
        prefix_cache: PrefixCache | None = None,
        max_kv_size: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
        speculation: Speculation | None = None,
    ):
        """``max_kv_size`` and ``kv_bits`` mean what they mean for ``generate``. mlx-lm
        has no batched quantized cache, so ``kv_bits`` needs ``max_batch_size`` 1; its
        batched rotating cache keeps no tokens at its start (the prompt's media, the
        attention sinks ``generate`` keeps), so with ``max_batch_size`` above 1 a request
        that would outgrow ``max_kv_size`` is refused at ``submit``. ``speculation``
        (speculative decoding, ``generate.speculative``): with ``max_batch_size`` 1 one
        sequence speculates on its own cache; above, the speculating requests share one
        batched verify pass (``SpeculativeBatch``), which needs whole KV caches (no
        ``max_kv_size``), and a sharded model's engine speculates one sequence only."""
        if max_batch_size < 1:
            raise MlxvlmError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if model.sharding is not None and not self.carries_passes_to_ranks:
            raise MlxvlmError(
                "batch_generate does not run on a sharded model: its ranks run stream_generate "
                "or the server (python -m mlxvlm.server under mlx.launch) in step")
        if prefill_step_size < 1:
            raise MlxvlmError(f"prefill_step_size must be at least 1, got {prefill_step_size}")
        self.cache_options = CacheOptions(max_kv_size, kv_bits, kv_group_size,
                                          quantized_kv_start)
        self.cache_options.validate()
        if kv_bits is not None and max_batch_size > 1:
            raise MlxvlmError(
                "kv_bits needs max_batch_size 1: mlx-lm has no batched quantized KV cache "
                f"(got max_batch_size {max_batch_size})"
            )
        if speculation is not None and max_batch_size > 1 and self.carries_passes_to_ranks:
            raise MlxvlmError(
                "a sharded model's server speculates one sequence at a time: serve it with "
                f"--max-concurrency 1 (got {max_batch_size}), or leave out --draft-model, "
                "--prompt-lookup-num-tokens and --mtp")
        if speculation is not None and max_batch_size > 1 and max_kv_size is not None:
            raise MlxvlmError(
                "speculative decoding with max_batch_size above 1 needs whole KV caches (a "
                "batched rotating cache cannot give rejected drafts back): leave out "
                "max_kv_size or use max_batch_size 1")
        self.speculation = speculation
        self._speculating: _Sequence | None = None
        # Above a batch of one, the speculating requests decode in a batch of their own.
        self._drafting = (SpeculativeBatch(model, speculation.num_tokens)
                          if speculation is not None and max_batch_size > 1 else None)
        # Which batched speculative steps draft (measured; SpeculationRule(adaptive=False):
        # all of them).
        self.speculation_rule = SpeculationRule()
        self.model = model
        self.processor = processor
        self.tokenizer = generation_tokenizer(processor)
        self.eos_token_ids = eos_token_ids(processor)
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self.prefix_cache = prefix_cache
        self.placeholders = np.fromiter(model.placeholder_token_ids, dtype=np.int64)
        self.stats = EngineStats()
        materialize(model)

        self._waiting: deque[_Sequence] = deque()
        self._prefilling: _Sequence | None = None
        self._batch = self.decode_batch_class(model, merged=max_batch_size > 1,
                                  quantize=self.cache_options.quantize)
        self._next_id = 0
        self._spoken = SpokenRows(model)
        self._init_thread()

    # -- the caller's side -----------------------------------------------------------

    def submit(
        self,
        inputs: PreparedInputs,
        options: SamplingOptions,
        deliver: Deliver,
        *,
        image_hashes: Sequence[str] | None = (),
        cache_namespace: str | None = None,
        speech: SpeechRequest | None = None,
    ) -> SequenceHandle:
        """Queue a prepared prompt. Raises ``MlxvlmError`` (e.g. ``PromptTooLongError``)
        at once for options or prompts that cannot run. ``image_hashes`` (see
        ``prefix_cache.image_hash``), in prompt order, let the prompt reuse a cache; None
        keeps it out of the prefix cache (e.g. media the keys cannot describe). Prompts
        share cached prefixes only within one ``cache_namespace`` (the server's API key).
        ``speech``: the answer is also spoken (``spoken_rows``; the talker's sampling
        seeded by ``options.seed``): ``BatchAudio`` items come between its steps, the last
        one after its last step."""
        options.validate()
        if speech is not None:
            # a model that does not speak, a voice it lacks, a sharded model
            check_speech_request(self.model, speech, {})
        max_tokens = options.max_tokens
        max_kv_size = self.cache_options.max_kv_size
        if max_kv_size is None:
            max_tokens = fit_to_context(self.model, inputs.num_tokens, max_tokens)
        elif self._batch.merged and inputs.num_tokens + max_tokens > max_kv_size:
            raise MlxvlmError(
                f"this request ({inputs.num_tokens} prompt tokens + max_tokens {max_tokens}) "
                f"would outgrow max_kv_size {max_kv_size}, and in a batch of several a "
                "rotating cache cannot keep the prompt's start (mlx-lm's batched rotating "
                "cache has no keep); use max_batch_size 1, a larger max_kv_size or fewer "
                "max_tokens"
            )
        if max_tokens < options.max_tokens:
            # The processors count the same budget the sequence stops at (a grammar
            # closes its answer in time for it).
            options = dataclasses.replace(options, max_tokens=max_tokens)
        key = None
        if self.prefix_cache is not None and image_hashes is not None:
            key = prompt_key(np.asarray(inputs.input_ids[0]), self.placeholders, image_hashes,
                             namespace=cache_namespace,
                             images_reach_every_token=self.model.media_condition_every_token)
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
                    text=SequenceText(self.tokenizer, self.eos_token_ids, options.stop, max_tokens,
                                      options.kept_token_ids),
                    row=RowSampler(options, inputs.input_ids[0]),
                    submitted_at=time.perf_counter(),
                    namespace=cache_namespace,
                    speech=speech,
                )
            )
            self.stats.waiting = len(self._waiting)
            self._cond.notify()
        return handle

    def close(self, timeout: float | None = 10.0) -> None:
        self._stop_thread(timeout)
        error = MlxvlmError("the engine is shutting down")
        for seq in self._drain():
            self._deliver(seq, error)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._batch.rows or self._speculating
                    or self._drafting or self._spoken)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._wait_for(lambda: self.has_work):
                    return
            try:
                self.step()
            except Exception as e:  # never leave callers waiting on a dead thread
                _log_failure(e, "the batching engine failed; failing its requests")
                failure = _fault_of(e, "the engine failed")
                for seq in self._drain():
                    self._fail(seq, failure, logged=True)

    def _drain(self) -> list[_Sequence]:
        with self._cond:
            pending = list(self._waiting)
            self._waiting.clear()
        if self._prefilling is not None:
            pending.append(self._prefilling)
            self._prefilling = None
        pending.extend(self._batch.rows)
        self._batch.clear()
        if self._speculating is not None:
            pending.append(self._speculating)
            self._speculating = None
        if self._drafting:
            pending.extend(row.seq for row in self._drafting.rows)
            self._drafting.keep([])
        # spoken requests whose text is written (the others are in the lists above)
        pending.extend(seq for seq in self._spoken.clear() if seq.written)
        self._update_gauges()
        return pending

    # -- one iteration -------------------------------------------------------------

    def step(self) -> None:
        """Admit the next waiting request, run one prefill chunk, run one decode step,
        give every ready talker a frame."""
        self._drop_cancelled_waiting()
        self._drop_cancelled_active()
        if (
            self._prefilling is None
            and self._waiting
            and self._active_rows() < self.max_batch_size
        ):
            with self._cond:
                seq = self._waiting.popleft()
            self._guard(seq, self._start_prefill)
        if self._prefilling is not None:
            self._guard(self._prefilling, self._advance_prefill)
        if self._speculating is not None:
            self._guard(self._speculating, self._speculative_step)
        if self._drafting:
            try:
                self._speculative_batch_step()
            except Exception as e:  # as a decode step's fault: its requests fail
                _log_failure(e, "a speculative step failed; failing its requests")
                failure = _fault_of(e, "the speculative step failed")
                for row in self._drafting.rows:
                    self._fail(row.seq, failure, logged=True)
                self._drafting.keep([])
        if self._batch.rows:
            try:
                self._decode_step()
            except Exception as e:  # a fault in the batch fails its requests, not the engine
                # (a fault of one row's own, e.g. its grammar, ends that row alone: see
                # _decode_step)
                _log_failure(e, "a decode step failed; failing the requests in the batch")
                failure = _fault_of(e, "the decode step failed")
                for seq in self._batch.rows:
                    self._fail(seq, failure, logged=True)
                self._batch.clear()
        if self._spoken:
            self._speech_step()
        self._update_gauges()

    def _active_rows(self) -> int:
        drafting = len(self._drafting) if self._drafting is not None else 0
        return len(self._batch) + (self._speculating is not None) + drafting

    def _guard(self, seq: _Sequence, action: Callable[[_Sequence], None]) -> None:
        try:
            action(seq)
        except Exception as e:
            if self._prefilling is seq:
                self._prefilling = None
            if self._speculating is seq:
                self._speculating = None
            self._fail(seq, e)

    def _fail(self, seq: _Sequence, error: BaseException, logged: bool = False) -> None:
        seq.failed = True
        self._spoken.forget(seq)
        self.stats.requests_failed += 1
        if not logged:
            _log_failure(error, f"request {seq.handle.id} failed")
        self._deliver(seq, error)

    @staticmethod
    def _unsound(seq: _Sequence) -> SequenceFault:
        """A token drawn from no real distribution ends its sequence, undelivered."""
        return SequenceFault(
            f"generation failed at token {len(seq.generated) + 1}: the model's scores "
            "were not numbers, or the request's options left no token to choose")

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
        rows = self._batch.rows
        # (a spoken row whose speaker failed between steps leaves too, already counted)
        keep = [i for i, seq in enumerate(rows) if not (seq.cancelled or seq.failed)]
        if len(keep) < len(rows):
            self.stats.requests_cancelled += sum(seq.cancelled for seq in rows)
            self._batch.keep(keep)
        for seq in list(self._spoken.requests.values()):
            if seq.cancelled:
                self._spoken.forget(seq)
                # one whose text was written left its row before: counted here
                self.stats.requests_cancelled += seq.written
        if self._drafting:
            rows = self._drafting.rows
            keep = [i for i, row in enumerate(rows) if not row.seq.cancelled]
            if len(keep) < len(rows):
                self.stats.requests_cancelled += len(rows) - len(keep)
                for i, row in enumerate(rows):
                    if row.seq.cancelled:
                        self._count_speculation(row.stats)
                self._drafting.keep(keep)

    def _update_gauges(self) -> None:
        self.stats.waiting = len(self._waiting)
        speaking = sum(seq.written for seq in self._spoken.requests.values())
        self.stats.active = self._active_rows() + (self._prefilling is not None) + speaking

    # -- prefill --------------------------------------------------------------------

    def _start_prefill(self, seq: _Sequence) -> None:
        """Encode the prompt (reusing a cached prefix when one matches) and set up the
        chunked prefill of the rest."""
        model, ids = self.model, seq.inputs.input_ids
        hit = None
        if seq.key is not None:  # a spoken request's entry must carry its tap's records
            hit = self.prefix_cache.lookup(seq.key, seq.namespace, spoken=seq.speech is not None)
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
        seq.cache = hit.cache if hit is not None else self.cache_options.make(model, seq.inputs)
        seq.state, seq.embeddings, seq.cached_tokens = state, embeddings, start
        boundaries: list[int] = []
        if hit is not None:
            seq.snapshots = hit.snapshots
        if seq.key is not None and any(is_state_cache(c) for c in seq.cache):
            # State layers cannot be trimmed: snapshot where the next turn will resume.
            ends = turn_boundaries(np.asarray(ids[0]).tolist(), self.eos_token_ids)
            boundaries = [end - start for end in ends]
        if self.speculation is not None and seq.speech is None:  # a spoken row never drafts
            seq.drafter = self.speculation.watching_drafter(model, seq.options, start,
                                                            self.prefill_step_size)
        seq.tap = SpokenRows.tap_for(seq.speech, model, hit.tap if hit is not None else None)
        seq.prefill = prefill_chunks(
            self._target_of(seq),
            ids[:, start:],
            embeddings,
            state,
            seq.cache,
            prefill_step_size=self.prefill_step_size,
            quantize=self.cache_options.quantize,
            snapshots=seq.snapshots if seq.key is not None else None,
            boundaries=boundaries,
        )
        self.stats.prompt_tokens += seq.inputs.num_tokens
        self.stats.cached_prompt_tokens += start
        self._prefilling = seq

    def _advance_prefill(self, seq: _Sequence) -> None:
        if seq.cancelled:
            self._prefilling = None
            self.stats.requests_cancelled += 1
            return
        with self._spoken.recording(seq.tap):
            done = next(seq.prefill, None)
        if done is not None:
            seq.prefilled = done
            return
        # The rest of the prompt (its final chunk) gives the first new token in the same
        # pass, as in generate_tokens; it is read at once (not overlapped), for the time
        # to first token.
        self._prefilling = None
        rest = seq.cached_tokens + seq.prefilled
        with mx.stream(generation_stream), self._spoken.recording(seq.tap):
            logits = self._target_of(seq)(
                seq.inputs.input_ids[:, rest:],
                seq.cache,
                embeddings=seq.embeddings[:, seq.prefilled :],
                state=seq.state,
                last_only=True,
            )[:, -1, :]
            self.cache_options.quantize(seq.cache)
            tokens, logprobs = sampling_step(logits, [seq.row])
            sane = sampled_sanely(tokens, logprobs)
            mx.eval(tokens, logprobs, sane)
            if seq.key is not None:  # the whole prompt: where its next turn resumes
                seq.snapshots.record(seq.cache, evaluate=True)
        seq.embeddings = None
        if not sane.item():
            raise self._unsound(seq)
        now = time.perf_counter()
        self.stats.time_to_first_token_sum += now - seq.submitted_at
        self.stats.time_to_first_token_count += 1
        wants = seq.options.top_logprobs is not None
        values = np.asarray(logprobs[0].astype(mx.float32)) if wants else None
        if seq.speech is not None:
            self._spoken.join(seq, self.eos_token_ids)
        outcome = self._emit(seq, tokens.item(), values)
        speculates = seq.speech is None and self.speculation is not None
        if outcome is _RUNNING and speculates and self._drafting is not None \
                and self._drafts_batched(seq):
            self._join_drafting(seq, tokens.item())
        elif outcome is _RUNNING and speculates and self.speculation.usable(seq.options) \
                and self._drafting is None:
            self._start_speculating(seq, tokens.item())
        elif outcome is _RUNNING:
            cache, seq.cache = seq.cache, None
            self._batch.join(seq, cache, seq.state, tokens, logprobs)
        elif outcome is _FINISHED:
            self._finished(seq, cache=seq.cache)
        elif outcome is _CANCELLED:
            self.stats.requests_cancelled += 1

    # -- speculative decoding (max_batch_size 1) --------------------------------------

    def _target_of(self, seq: _Sequence) -> Any:
        """The model as a sequence's prefill calls it: through its drafter where that
        watches the passes."""
        return self.model if seq.drafter is None else seq.drafter.recording(self.model)

    def _start_speculating(self, seq: _Sequence, first: int) -> None:
        seq.held = []
        seq.speculation_stats = SpeculationStats()
        drafter = seq.drafter or self.speculation.drafter(self.model, seq.inputs, seq.options,
                                                          self.prefill_step_size)
        seq.speculative = speculative_decode(
            self.model, seq.cache, seq.state, seq.inputs.input_ids[0].tolist(), first,
            max_tokens=seq.text.max_tokens, row=seq.row, options=seq.options, drafter=drafter,
            num_draft_tokens=self.speculation.num_tokens, stats=seq.speculation_stats,
            quantize=self.cache_options.quantize, held=seq.held)
        self._speculating = seq

    def _speculative_step(self, seq: _Sequence) -> None:
        """One token of the speculating request (a target pass when its last one's
        tokens are all delivered)."""
        started = time.perf_counter()
        outcome = _CANCELLED
        if not seq.cancelled:
            token, logprobs = next(seq.speculative)
            wants = seq.options.top_logprobs is not None
            outcome = self._emit(seq, token, np.asarray(logprobs) if wants else None)
            self._update_throughput(1, time.perf_counter() - started)
        if outcome is _RUNNING:
            return
        self._speculating = None
        seq.speculative.close()
        seq.drafter = None
        self._count_speculation(seq.speculation_stats)
        if outcome is _FINISHED:
            self._finished(seq, seq.cache if self._keeps_cache(seq) else None, fed=seq.held)
        else:
            self.stats.requests_cancelled += 1

    # -- speculative decoding of a batch (max_batch_size above 1) ----------------------

    def _drafts_batched(self, seq: _Sequence) -> bool:
        """Whether a request speculates: not a grammar's, and only where its caches can
        be taken back row by row (else it decodes plainly, e.g. a sliding window's)."""
        return self.speculation.usable(seq.options) and rewindable(seq.cache)

    def _join_drafting(self, seq: _Sequence, first: int) -> None:
        seq.speculation_stats = SpeculationStats()
        drafter = seq.drafter or self.speculation.drafter(self.model, seq.inputs, seq.options,
                                                          self.prefill_step_size)
        seq.drafter = None
        cache, seq.cache = seq.cache, None
        self._drafting.join(seq, cache, drafter, first, seq.speculation_stats)

    def _count_speculation(self, stats: SpeculationStats) -> None:
        self.stats.drafted_tokens += stats.drafted
        self.stats.accepted_draft_tokens += stats.accepted
        self.stats.stopped_drafts += stats.stopped_drafting

    def _speculative_batch_step(self) -> None:
        """One batched verify pass; each row's tokens delivered, rows that end leave."""
        drafting = self._drafting
        started = time.perf_counter()
        self.stats.peak_batch_size = max(self.stats.peak_batch_size, self._active_rows())
        speculate = self.speculation_rule.speculates(len(drafting))
        verdicts = drafting.step(speculate)
        keep, delivered = [], 0
        for i, (row, verdict) in enumerate(zip(drafting.rows, verdicts)):
            seq = row.seq
            if verdict.failure is not None:
                failure = verdict.failure
                if isinstance(failure, FloatingPointError):
                    failure = self._unsound(seq)
                self._count_speculation(row.stats)
                self._fail(seq, failure)
                continue
            wants = seq.options.top_logprobs is not None
            values = np.asarray(verdict.logprobs) if wants else None
            outcome = _RUNNING
            for j, token in enumerate(verdict.tokens):
                outcome = self._emit(seq, token, values[j] if wants else None)
                delivered += 1
                if outcome is not _RUNNING:
                    break
            if outcome is _RUNNING:
                keep.append(i)
                continue
            self._count_speculation(row.stats)
            if outcome is _FINISHED:
                cache = drafting.extract(i) if self._keeps_cache(seq) else None
                self._finished(seq, cache, fed=row.held)
            else:
                self.stats.requests_cancelled += 1
        self.speculation_rule.observe(len(drafting), speculate, delivered,
                                      time.perf_counter() - started)
        self._update_throughput(delivered, time.perf_counter() - started)
        drafting.keep(keep)

    # -- decode ---------------------------------------------------------------------

    def _decode_step(self) -> None:
        """Schedule the next step, then deliver the tokens of the one before it (computed
        meanwhile). A row at its token budget gets no step past its last token."""
        batch = self._batch
        started = time.perf_counter()
        self.stats.peak_batch_size = max(self.stats.peak_batch_size, len(batch))
        rows, tokens, logprobs, unread = list(batch.rows), batch.tokens, batch.logprobs, list(batch.unread)
        batch_sane = batch.sane
        ending = {i for i, seq in enumerate(rows) if seq.row.sampled >= seq.text.max_tokens}
        last_caches = {i: batch.extract(i) for i in ending if self._keeps_cache(rows[i])}
        going_on = [i for i in range(len(rows)) if i not in ending]
        batch.keep(going_on)
        if going_on:
            with self._spoken.recording(self._spoken.rows_tap(batch.rows)):
                batch.step()

        values = tokens.tolist()
        sane = batch_sane.tolist()
        read_logprobs = None
        if any(seq.options.top_logprobs is not None for seq in rows):
            read_logprobs = np.asarray(logprobs.astype(mx.float32))
        position = {i: p for p, i in enumerate(going_on)}
        keep, delivered = [], 0
        for i, seq in enumerate(rows):
            # A row's own failure ends it alone; the batch goes on without it.
            if unread[i] and not sane[i]:
                self._fail(seq, self._unsound(seq))
                continue
            outcome = _RUNNING  # (a first token was delivered after its prefill)
            if unread[i]:
                delivered += 1
                wants = seq.options.top_logprobs is not None
                outcome = self._emit(seq, values[i], read_logprobs[i] if wants else None)
            if outcome is _RUNNING and seq.row.failure is not None:
                self._fail(seq, seq.row.failure)  # its next step could not be built
            elif outcome is _RUNNING:
                keep.append(position[i])
            elif outcome is _CANCELLED:
                self.stats.requests_cancelled += 1
            elif outcome is _FAILED:
                continue  # its failure is delivered: its row leaves
            elif i in ending:
                self._finished(seq, cache=last_caches.get(i))
            else:
                cache = batch.extract(position[i]) if self._keeps_cache(seq) else None
                self._finished(seq, cache=cache)
        self._update_throughput(delivered, time.perf_counter() - started)
        batch.keep(keep)

    # -- spoken requests (``spoken_rows``) ------------------------------------------

    def _heard(self, seq: _Sequence, token: int, finished: bool) -> bool:
        """``seq``'s speaker hears the token just delivered; False if it failed (its
        failure delivered: the request ends alone)."""
        failure = self._spoken.heard(seq, token, finished)
        if failure is not None:
            self._fail(seq, failure)
            return False
        if finished:
            seq.written = True
            speech = self._spoken.written(seq)
            if speech is not None:  # its talker had ended before its text
                self._spoken_done(seq, speech)
        return True

    def _speech_step(self) -> None:
        """A frame for every ready talker, each chunk decoded delivered to its request.
        A speaker's own failure fails its request alone; a fault of the step itself fails
        the spoken requests, not the text rows."""
        try:
            given = self._spoken.step()
        except Exception as e:
            _log_failure(e, "a talker step failed; failing the spoken requests")
            failure = _fault_of(e, "the talker step failed")
            for seq in self._spoken.clear():
                self._fail(seq, failure, logged=True)
            return
        for seq, spoken in given:
            if seq.cancelled:  # it leaves at the next step
                continue
            for chunk in spoken.chunks:
                self._deliver(seq, BatchAudio(chunk))
            if spoken.failure is not None:
                self._fail(seq, spoken.failure)
            elif spoken.speech is not None:
                speech = self._spoken.ended(seq, spoken.speech)
                if speech is not None:
                    self._spoken_done(seq, speech)

    def _spoken_done(self, seq: _Sequence, speech: Any) -> None:
        """Both ``seq``'s text and speech are complete: its last item."""
        self.stats.requests_finished += 1
        self._deliver(seq, BatchAudio(np.zeros(0, np.float32), speech))

    def _keeps_cache(self, seq: _Sequence) -> bool:
        return self.prefix_cache is not None and seq.key is not None

    def _emit(self, seq: _Sequence, token: int, logprobs: np.ndarray | None) -> str:
        """Deliver one token; whether the request goes on, finished or was cancelled."""
        if seq.cancelled:
            return _CANCELLED
        seq.generated.append(token)
        segment, finish_reason = seq.text.add(token)
        step = BatchStep(
            text=segment,
            token=token,
            finish_reason=finish_reason,
            prompt_tokens=seq.inputs.num_tokens,
            cached_tokens=seq.cached_tokens,
            generation_tokens=len(seq.generated),
            stop_string=seq.text.stop_string,
        )
        if seq.options.top_logprobs is not None:
            step.logprob, step.top_logprobs = token_logprobs(
                logprobs, token, seq.options.top_logprobs)
        self.stats.generated_tokens += 1
        self._deliver(seq, step)
        if finish_reason is not None and seq.tap is not None and seq.key is not None:
            # taken now: its speaker may end (and its tap go) as it hears this token
            seq.tap_records = seq.tap.records()
        if seq.speech is not None and not self._heard(seq, token, finish_reason is not None):
            return _FAILED
        if finish_reason is not None:
            # Decided here: the caller may cancel as soon as it has the last step.
            return _FINISHED
        return _CANCELLED if seq.cancelled else _RUNNING

    def _finished(self, seq: _Sequence, cache: list[Any] | None,
                  fed: list[int] | None = None) -> None:
        if seq.speech is None:  # a spoken one's text only: it finishes when its speech ends
            self.stats.requests_finished += 1
        if cache is not None and self.prefix_cache is not None and seq.key is not None:
            # The cache holds the prompt and every generated token fed back: all but the
            # last sampled one (a speculating request's: the tokens it took in).
            fed = seq.generated[: seq.row.sampled - 1] if fed is None else fed
            key = np.concatenate([seq.key, np.asarray(fed, dtype=np.int64)])
            self.prefix_cache.insert(key, cache, self.model.stored_state(seq.state),
                                     seq.snapshots, namespace=seq.namespace,
                                     tap=seq.tap_records)
            seq.tap_records = None

    def _update_throughput(self, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate = tokens / seconds
        previous = self.stats.decode_tokens_per_second
        self.stats.decode_tokens_per_second = rate if previous == 0 else 0.9 * previous + 0.1 * rate
