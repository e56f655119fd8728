"""The shared token loop: chunked prefill, then one sampling step per token, each step
scheduled before the previous token is read.

The family turns the prompt into embeddings (running its vision/audio towers) and
embeddings into logits; the loop owns the cache's filling and the decode steps.
``prefill_chunks``, ``embed_prompt`` and ``sampling_step`` are shared with the batching
engine, so that a request's prefill and sampling are the same computation in both.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.distributed.broadcast import rank0_token
from mlxvlm.errors import PromptTooLongError
from mlxvlm.generate.state_cache import StateSnapshots, cache_offset
from mlxvlm.models.run_ahead import bounded_run_ahead
from mlxvlm.prompt import PreparedInputs
from mlxvlm.sampling import RowSampler, sampling_step

# A dedicated stream keeps generation work off the default stream other code may use.
# Thread-local (as mlx-lm's), since MLX streams belong to the thread that made them: the
# server's engine thread and the UI's worker threads each get their own.
generation_stream = mx.new_thread_local_stream(mx.default_device())


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
    snapshots: StateSnapshots | None = None,
    boundaries: Sequence[int] = (),
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
    the same computation in both. ``snapshots`` records the state layers' states (see
    ``state_cache``) after each chunk: lengths a later prompt may resume from.
    ``boundaries`` (positions in ``input_ids``) are where a chunk must end, so that a
    snapshot is taken there, even inside what would be the final chunk.
    """
    total = input_ids.shape[1]
    done = 0
    # The model's bidirectional spans, made relative to input_ids (which start at the
    # cache's offset): a chunk never ends inside one.
    start = cache_offset(cache)
    spans = [(s - start, e - start) for s, e in model.bidirectional_spans(state)]
    cuts = sorted(b for b in boundaries if 0 < b < total)
    with mx.stream(generation_stream):
        while True:
            n = prefill_step_size
            cut = next((b for b in cuts if b > done), None)
            if cut is not None and cut - done < n:
                n = cut - done
            elif total - done <= prefill_step_size:
                break  # the final chunk: the first sampling step takes it
            n = _chunk_length(done, n, spans)
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
            if snapshots is not None:
                snapshots.record(cache)
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


def prefill_prompt(
    model: nn.Module,
    inputs: PreparedInputs,
    cache: list[Any],
    prefill_step_size: int,
    quantize: Callable[[list[Any]], None],
    progress: Callable[[int, int], None],
    embedded: tuple[mx.array, Any] | None = None,
) -> tuple[mx.array, Any, int]:
    """The prompt embedded and all but its final chunk prefilled into ``cache``, with
    progress reported: ``(embeddings, state, done)``, the final chunk being
    ``embeddings[:, done:]`` (for the first sampling step). Shared by ``generate_tokens``
    and speculative decoding. ``embedded``: the prompt's ``(embeddings, state)`` made
    already (a sharded model's ranks get rank 0's)."""
    input_ids = inputs.input_ids
    if embedded is None:
        embedded = embed_prompt(model, input_ids, **inputs.features)
    embeddings, state = embedded
    total = input_ids.shape[1]
    progress(0, total)
    done = 0
    for done in prefill_chunks(model, input_ids, embeddings, state, cache,
                               prefill_step_size=prefill_step_size, quantize=quantize):
        progress(done, total)
    return embeddings, state, done


def generate_tokens(
    model: nn.Module,
    inputs: PreparedInputs,
    *,
    cache: list[Any],
    max_tokens: int,
    row: RowSampler,
    prefill_step_size: int = 2048,
    quantize: Callable[[list[Any]], None] | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    embedded: tuple[mx.array, Any] | None = None,
) -> Generator[tuple[int, mx.array], None, None]:
    """Yield ``(token, logprobs)``; prefill the prompt's embeddings in chunks first.
    ``row`` samples each token; ``quantize`` (``CacheOptions.quantize``) runs after each
    pass. ``embedded``: the prompt's ``(embeddings, state)`` made already (a sharded
    model's ranks get rank 0's); on a sharded model every rank feeds rank 0's token."""
    progress = prompt_progress_callback or (lambda *_: None)
    quantize = quantize or (lambda _: None)
    input_ids = inputs.input_ids
    total = input_ids.shape[1]
    sharding = model.sharding
    embeddings, state, done = prefill_prompt(model, inputs, cache, prefill_step_size,
                                             quantize, progress, embedded=embedded)

    def step(tokens: mx.array, chunk_embeddings: mx.array | None = None):
        with mx.stream(generation_stream):
            logits = model(tokens, cache, embeddings=chunk_embeddings, state=state, last_only=True)
            quantize(cache)
            fed = tokens[0] if chunk_embeddings is None else None
            sampled, logprobs = sampling_step(logits[:, -1, :], [row], fed)
            if sharding is not None:
                sampled = rank0_token(sampled, sharding.group)
            return sampled, logprobs.squeeze(0)

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
        try:
            yield token, current[1]
        except GeneratorExit:
            # The caller stopped on this token (end of sequence, a stop string) with the
            # next step already scheduled. On a sharded model that step's collectives
            # are still in flight: they finish here, on every rank alike, so that the
            # group's next collective (rank 0's next job or its release) is not read
            # into this step's.
            if ahead and sharding is not None:
                mx.eval(*upcoming)
            raise
        if last:
            break
        if not ahead:
            upcoming = schedule(current[0].reshape(1, 1))
        if n % 256 == 0:
            mx.clear_cache()
        current = upcoming


def fit_to_context(model: nn.Module, prompt_tokens: int, max_tokens: int) -> int:
    """``max_tokens`` cut to the room the model's context leaves after the prompt; a
    prompt that fills the context is a ``PromptTooLongError`` naming both lengths."""
    context = model.max_context
    if context is None:
        return max_tokens
    if prompt_tokens >= context:
        raise PromptTooLongError.of_tokens(prompt_tokens, context)
    return min(max_tokens, context - prompt_tokens)


