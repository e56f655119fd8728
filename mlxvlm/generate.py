"""The shared generate loop, and ``python -m mlxvlm.generate``.

One loop for every family: the family turns the prompt into embeddings (running its
vision/audio towers) and embeddings into logits; the loop owns the KV cache, chunked
prefill, sampling, stopping and streaming detokenization. Sampling, logits processors,
detokenizers and caches come from mlx-lm.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.sample_utils import make_logits_processors

from mlxvlm.errors import MlxvlmError, PromptTooLongError
from mlxvlm.models.run_ahead import bounded_run_ahead
from mlxvlm.prompt import PreparedInputs, prepare_inputs
from mlxvlm.sampling import build_sampler
from mlxvlm.sampling_defaults import checkpoint_defaults, invalid_sampling_value
from mlxvlm.sampling_defaults import resolve as resolve_sampling
from mlxvlm.tokenization import generation_tokenizer

# A dedicated stream keeps generation work off the default stream other code may use.
# Thread-local (as mlx-lm's), since MLX streams belong to the thread that made them: the
# server's engine thread and the UI's worker threads each get their own.
generation_stream = mx.new_thread_local_stream(mx.default_device())

# mlx-lm's default: quantize the KV cache only once it is long enough to matter.
DEFAULT_QUANTIZED_KV_START = 5000
# Tokens always kept at the start of a rotating cache (attention sinks), as mlx-lm does.
ROTATING_KEEP = 4


@dataclass
class GenerationResult:
    """One step of ``stream_generate``: the new text segment and running statistics."""

    text: str
    token: int | None
    logprobs: mx.array | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop" | "length" on the last result


@dataclass
class GenerationOutput:
    """What ``generate`` returns: the whole text plus the final statistics."""

    text: str
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    peak_memory: float = 0.0
    finish_reason: str | None = None


def make_generation_cache(
    model: nn.Module, inputs: PreparedInputs, max_kv_size: int | None
) -> list[Any]:
    """The family's cache; with ``max_kv_size``, full caches become rotating ones that
    always keep the prompt's media tokens (and the first few tokens)."""
    cache = model.make_cache()
    if max_kv_size is None:
        return cache
    ids = inputs.input_ids[0].tolist()
    placeholders = model.placeholder_token_ids
    last_media = max((i for i, t in enumerate(ids) if t in placeholders), default=-1)
    keep = max(ROTATING_KEEP, last_media + 1)
    if keep >= max_kv_size:
        raise PromptTooLongError(
            f"--max-kv-size {max_kv_size} is too small: the prompt's media (images, video, "
            f"audio) end at token {last_media + 1}, and a rotating cache must keep them all "
            f"plus room for new tokens; use a --max-kv-size above {keep} (or less media)"
        )
    return [
        RotatingKVCache(max_size=max_kv_size, keep=keep) if type(c) is KVCache else c
        for c in cache
    ]


def _maybe_quantize_cache(cache, *, kv_bits, kv_group_size, quantized_kv_start):
    if kv_bits is None:
        return
    for i, c in enumerate(cache):
        if type(c) is KVCache and c.offset >= quantized_kv_start:
            cache[i] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)


def _chunk_length(done: int, n: int, spans: list[tuple[int, int]]) -> int:
    """``n``, or more so that the chunk starting at ``done`` ends at the end of the span
    it would otherwise cut."""
    for span_start, span_end in spans:
        if span_start < done + n < span_end:
            n = span_end - done
    return n


def prefill_chunks(
    model: nn.Module,
    input_ids: mx.array,
    embeddings: mx.array,
    state: Any,
    cache: list[Any],
    *,
    prefill_step_size: int,
    quantize: Callable[[list[Any]], None] | None = None,
) -> Generator[int, None, None]:
    """Run ``input_ids`` (and their ``embeddings``) but their final chunk through the
    model into ``cache``, in chunks of ``prefill_step_size``; yield how many are done after
    each.

    The final chunk (at most ``prefill_step_size`` tokens, more only where a bidirectional
    span reaches the prompt's end) is left for the caller's first sampling step, which
    runs it and takes the logits of its last position in the same pass (``last_only``): a
    prompt's last token costs no pass of its own. The tokens are the part of the prompt
    not yet in ``cache``: all of it, or what follows a reused prefix.
    Shared by ``generate_tokens`` and the batching engine, so that a request's prefill is
    the same computation in both.
    """
    total = input_ids.shape[1]
    done = 0
    # The model's bidirectional spans, made relative to input_ids (which start at the
    # cache's offset): a chunk never ends inside one.
    start = cache[0].offset if cache else 0
    spans = [(s - start, e - start) for s, e in model.bidirectional_spans(state)]
    with mx.stream(generation_stream):
        while total - done > prefill_step_size:
            n = _chunk_length(done, prefill_step_size, spans)
            if done + n >= total:
                break  # a span reaches the prompt's end: the first sampling step takes it
            model(
                input_ids[:, done : done + n],
                cache,
                embeddings=embeddings[:, done : done + n],
                state=state,
            )
            if quantize is not None:
                quantize(cache)
            mx.eval([c.state for c in cache])
            done += n
            mx.clear_cache()
            yield done


def embed_prompt(model: nn.Module, input_ids: mx.array, **features: Any) -> tuple[mx.array, Any]:
    """``model.embed(input_ids, **features)``, evaluated on the generation stream with the
    towers built inside ``bounded_run_ahead`` (a layer at a time on the CPU, with the
    feature cache on or off). Shared by ``generate_tokens`` and the batching engine."""
    with mx.stream(generation_stream), bounded_run_ahead():
        embeddings, state = model.embed(input_ids, **features)
        mx.eval(embeddings, state)
    return embeddings, state


def generate_tokens(
    model: nn.Module,
    inputs: PreparedInputs,
    *,
    cache: list[Any],
    max_tokens: int,
    sampler: Callable[[mx.array], mx.array],
    logits_processors: Sequence[Callable] = (),
    prefill_step_size: int = 2048,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
) -> Generator[tuple[int, mx.array], None, None]:
    """Yield ``(token, logprobs)``; prefill the prompt's embeddings in chunks first."""
    progress = prompt_progress_callback or (lambda *_: None)
    quantize = functools.partial(
        _maybe_quantize_cache,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )
    input_ids = inputs.input_ids
    history = input_ids[0] if logits_processors else None

    embeddings, state = embed_prompt(model, input_ids, **inputs.features)

    def step(tokens: mx.array, chunk_embeddings: mx.array | None = None):
        nonlocal history
        with mx.stream(generation_stream):
            logits = model(tokens, cache, embeddings=chunk_embeddings, state=state, last_only=True)
            logits = logits[:, -1, :]
            if logits_processors:
                if chunk_embeddings is None:
                    history = mx.concatenate([history, tokens[0]])
                for processor in logits_processors:
                    logits = processor(history, logits)
            quantize(cache)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return sampler(logprobs), logprobs.squeeze(0)

    total = input_ids.shape[1]
    progress(0, total)
    done = 0
    for done in prefill_chunks(
        model, input_ids, embeddings, state, cache,
        prefill_step_size=prefill_step_size, quantize=quantize,
    ):
        progress(done, total)

    def schedule(tokens: mx.array, chunk_embeddings: mx.array | None = None):
        result = step(tokens, chunk_embeddings)
        mx.async_eval(*result)
        return result

    # Step n + 1 is scheduled before token n is read, so that building its graph overlaps
    # token n's computation. On the CPU, MLX's async_eval returns only once all but the
    # last few dozen operations have run, so scheduling the second step before reading
    # the first token would hold that token back by a whole step (~65 ms of SmolVLM's time
    # to first token): there the first token is read first.
    first_token_first = generation_stream.device == mx.cpu
    current = schedule(input_ids[:, done:], embeddings[:, done:])
    for n in range(max_tokens):
        last = n + 1 == max_tokens
        ahead = not last and not (n == 0 and first_token_first)
        if ahead:
            upcoming = schedule(current[0].reshape(1, 1))
        token = current[0].item()
        if n == 0:
            progress(total, total)
        yield token, current[1]
        if last:
            break
        if not ahead:
            upcoming = schedule(current[0].reshape(1, 1))
        if n % 256 == 0:
            mx.clear_cache()
        current = upcoming


class StopStrings:
    """Cuts the stream at the first stop string, holding back text that may begin one."""

    def __init__(self, stops: Iterable[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self.held = ""

    def push(self, segment: str) -> tuple[str, bool]:
        text = self.held + segment
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        self.held = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def _as_stop_list(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class SequenceText:
    """One sequence's generated tokens as text, and the reason it ends.

    ``add(token)`` returns the new text segment (empty while a multi-byte character or a
    possible stop string is pending) and ``"stop"`` (an end-of-sequence id or a stop
    string), ``"length"`` (``max_tokens`` reached) or None. Shared by ``stream_generate``
    and the batching engine, so that both end a sequence by the same rules.
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: set[int],
        stop: str | Sequence[str] | None,
        max_tokens: int,
    ):
        self.detokenizer = tokenizer.detokenizer  # a fresh copy per sequence
        self.detokenizer.reset()
        self.eos_token_ids = eos_token_ids
        self.stops = StopStrings(_as_stop_list(stop))
        self.max_tokens = max_tokens
        self.num_tokens = 0

    def add(self, token: int) -> tuple[str, str | None]:
        self.num_tokens += 1
        finish_reason = None
        if token in self.eos_token_ids:
            finish_reason = "stop"
        else:
            self.detokenizer.add_token(token)
            if self.num_tokens >= self.max_tokens:
                finish_reason = "length"
        if finish_reason is not None:
            self.detokenizer.finalize()
        segment, hit_stop = self.stops.push(self.detokenizer.last_segment)
        if hit_stop:
            finish_reason = "stop"
        elif finish_reason is not None:
            segment += self.stops.flush()
        return segment, finish_reason


def eos_token_ids(processor: Any) -> set[int]:
    """Every end-of-sequence id (config.json, generation_config.json and tokenizer)."""
    tokenizer = generation_tokenizer(processor)
    return set(getattr(processor, "eos_token_ids", None) or tokenizer.eos_token_ids)


def fit_to_context(model: nn.Module, prompt_tokens: int, max_tokens: int) -> int:
    """``max_tokens`` cut to the room the model's context leaves after the prompt; a
    prompt that fills the context is a ``PromptTooLongError`` naming both lengths."""
    context = model.max_context
    if context is None:
        return max_tokens
    if prompt_tokens >= context:
        raise PromptTooLongError(
            f"the prompt is {prompt_tokens} tokens long but the model's context is "
            f"{context} tokens; shorten the prompt or use fewer/smaller images, shorter "
            "videos (or a lower --fps) or shorter audio"
        )
    return min(max_tokens, context - prompt_tokens)


def stream_generate(
    model: nn.Module,
    processor: Any,
    prompt: str | Sequence[dict],
    image: Any = None,
    *,
    video: Any = None,
    audio: Any = None,
    fps: float | None = None,
    max_frames: int | None = None,
    max_tokens: int = 256,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    seed: int | None = None,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prefill_step_size: int = 2048,
    stop: str | Sequence[str] | None = None,
    system: str | None = None,
    raw_prompt: bool = False,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: Sequence[Callable] | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    media_options: dict | None = None,
) -> Generator[GenerationResult, None, None]:
    """Generate text for a prompt (a string or chat messages) and images, videos or audio,
    step by step (``video``/``audio`` as ``prepare_inputs`` takes them; ``fps`` and
    ``max_frames`` say how videos are sampled, see ``mlxvlm.media.load_video``).

    Each result carries the new text segment (possibly empty while a multi-byte character
    or a possible stop string is pending), the token, its log-probabilities and running
    statistics; the last one has ``finish_reason`` "stop" or "length".

    A sampling value left out (None) comes from the checkpoint's generation_config.json,
    else is greedy / off (see ``mlxvlm.sampling_defaults``).
    """
    chosen = resolve_sampling(
        dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
             repetition_penalty=repetition_penalty),
        checkpoint_defaults(processor),
    ).values
    problem = invalid_sampling_value(
        dict(chosen, max_tokens=max_tokens, seed=seed,
             repetition_context_size=repetition_context_size)
    )
    if problem is not None:
        raise MlxvlmError(problem)
    if prefill_step_size < 1:
        raise MlxvlmError(f"prefill_step_size must be at least 1, got {prefill_step_size}")
    if kv_bits is not None and max_kv_size is not None:
        raise MlxvlmError(
            "--kv-bits cannot be combined with --max-kv-size: mlx-lm's rotating KV cache "
            "cannot be quantized; choose one"
        )
    if seed is not None:
        mx.random.seed(seed % 2**64)  # MLX takes an unsigned 64-bit seed
    tokenizer = generation_tokenizer(processor)
    eos_ids = eos_token_ids(processor)

    start = time.perf_counter()
    mx.reset_peak_memory()
    video_options = {k: v for k, v in (("fps", fps), ("max_frames", max_frames)) if v is not None}
    inputs = prepare_inputs(
        processor,
        prompt,
        image,
        video=video,
        audio=audio,
        system=system,
        raw_prompt=raw_prompt,
        feature_names=getattr(model, "feature_names", None),
        media_options=media_options,
        video_options=video_options,
    )
    prompt_tokens = inputs.num_tokens
    if max_kv_size is None:
        max_tokens = fit_to_context(model, prompt_tokens, max_tokens)

    cache = make_generation_cache(model, inputs, max_kv_size)
    if sampler is None:
        sampler = build_sampler(
            chosen["temperature"], chosen["top_p"], chosen["top_k"], chosen["min_p"]
        )
    if logits_processors is None:
        logits_processors = make_logits_processors(
            repetition_penalty=chosen["repetition_penalty"],
            repetition_context_size=repetition_context_size,
        )

    text = SequenceText(tokenizer, eos_ids, stop, max_tokens)
    tokens = generate_tokens(
        model,
        inputs,
        cache=cache,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prefill_step_size=prefill_step_size,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        prompt_progress_callback=prompt_progress_callback,
    )

    prompt_tps = 0.0
    decode_start = start
    for n, (token, logprobs) in enumerate(tokens):
        if n == 0:
            decode_start = time.perf_counter()
            prompt_tps = prompt_tokens / (decode_start - start)
        segment, finish_reason = text.add(token)
        elapsed = time.perf_counter() - decode_start
        yield GenerationResult(
            text=segment,
            token=token,
            logprobs=logprobs,
            prompt_tokens=prompt_tokens,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
        )
        if finish_reason is not None:
            break


def generate(model: nn.Module, processor: Any, prompt, image: Any = None, **kwargs) -> GenerationOutput:
    """Generate the whole answer; same arguments as ``stream_generate``."""
    output = GenerationOutput(text="")
    pieces = []
    for result in stream_generate(model, processor, prompt, image, **kwargs):
        pieces.append(result.text)
        output.tokens.append(result.token)
        output.prompt_tokens = result.prompt_tokens
        output.prompt_tps = result.prompt_tps
        output.generation_tokens = result.generation_tokens
        output.generation_tps = result.generation_tps
        output.peak_memory = result.peak_memory
        output.finish_reason = result.finish_reason
    output.text = "".join(pieces)
    return output


def main(argv: Sequence[str] | None = None) -> int:
    from mlxvlm.cli import run_generate_cli

    return run_generate_cli(argv)


if __name__ == "__main__":
    raise SystemExit(main())
