"""``stream_generate`` and ``generate``: one prompt (text, chat messages, images, video,
audio) through the shared token loop, as text segments with running statistics."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.distributed.jobs import GenerationJob, announce, leads, peer_checked
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.cache import CacheOptions
from mlxvlm.generate.drafters import make_drafter
from mlxvlm.generate.keywords import build_options, fold_keywords
from mlxvlm.generate.loop import embed_prompt, fit_to_context, generate_tokens
from mlxvlm.generate.speech import SpeechRequest, check_speech_request, thinker_states
from mlxvlm.generate.speculative import (
    SpeculationOptions,
    SpeculationStats,
    check_speculation,
    speculative_tokens,
)
from mlxvlm.generate.text import GenerationOutput, OutputFolder, SequenceText, eos_token_ids
from mlxvlm.media.options import MediaOptions
from mlxvlm.prompt import PreparedInputs, prepare_inputs
from mlxvlm.retrieval.api import check_generates
from mlxvlm.sampling.constrained import json_schema_constraint
from mlxvlm.sampling import RowSampler, SamplingOptions, token_logprobs
from mlxvlm.sampling.defaults import resolve as resolve_sampling
from mlxvlm.speech.pipeline import AnswerSpeaker, Speech
from mlxvlm.text.tokenization import generation_tokenizer, processor_state, tokenizer_of


@dataclass
class GenerationResult:
    """One step of ``stream_generate``: the new text segment and running statistics."""

    text: str
    token: int | None
    logprobs: mx.array | None  # the whole distribution
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop" | "length" on the last result
    # With top_logprobs (as the batching engine's BatchStep): the token's log-probability
    # and its top_logprobs most likely alternatives (None for 0).
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # With a draft model or prompt lookup: how speculation has gone so far.
    speculation: SpeculationStats | None = None
    stop_string: str | None = None  # on the last result: the stop string that ended it
    # With audio_output: a result that carries speech only (token None, text ""): the
    # next chunk of the answer's waveform, float32 mono at sample_rate, as decoded. These
    # come between the text's results (the talker follows the thinker) and after its
    # last one; the stream's last result has ``speech`` (the whole of it: codes, voice,
    # first_audio_seconds from the call's start, the talker and codec's seconds).
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    speech: Speech | None = None


def sampling_options(processor: Any, **given: Any) -> SamplingOptions:
    """``SamplingOptions`` from the Python API's keywords: those left out (None) from the
    checkpoint's generation_config.json, else greedy / off; validated."""
    chosen = resolve_sampling(given, processor_state(processor).sampling_defaults).values
    options = SamplingOptions(**{**{k: v for k, v in given.items() if v is not None}, **chosen})
    options.validate()
    return options


def stream_generate(
    model: nn.Module,
    processor: Any,
    prompt: str | Sequence[dict],
    image: Any = None,
    *,
    video: Any = None,
    audio: Any = None,
    max_tokens: int | None = None,
    sampling: SamplingOptions | None = None,
    cache: CacheOptions | None = None,
    media: MediaOptions | None = None,
    speculation: SpeculationOptions | None = None,
    audio_output: bool = False,
    voice: str | None = None,
    talker_temperature: float | None = None,
    talker_max_frames: int = 4096,
    **kwargs: Any,
) -> Generator[GenerationResult, None, None]:
    """Generate text for a prompt (a string or chat messages) and images, videos or audio,
    step by step (``video``/``audio`` as ``prepare_inputs`` takes them).

    Each result carries the new text segment (possibly empty while a multi-byte character
    or a possible stop string is pending), the token, its log-probabilities and running
    statistics; the last one has ``finish_reason`` "stop" or "length".

    ``max_tokens`` (256 unless ``sampling`` sets it) and the options objects:
    ``sampling`` (``SamplingOptions``, used as given), ``cache`` (``CacheOptions``),
    ``media`` (``MediaOptions``: ``fps``, ``max_frames``, ``media_policy``) and
    ``speculation`` (``SpeculationOptions``). Each field of these may be given flat
    instead (``temperature=``, ``max_kv_size=``, ``fps=``, ``draft_model=`` ...), but not
    both ways. A flat sampling value left out (None) comes from the checkpoint's
    generation_config.json, else is greedy / off (see ``mlxvlm.sampling.defaults``).
    ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` (token id -> bias) and
    ``top_logprobs`` mean what they mean in OpenAI's API (and the server). A ``seed``
    samples the same tokens here as in ``batch_generate`` and the server.

    The other keywords: ``system``, ``raw_prompt``, ``chat_template_kwargs`` (to the chat
    template, e.g. ``{"enable_thinking": False}`` for the Qwen3 and Qwen3.5 templates),
    ``json_schema`` (the answer is JSON valid under this schema, ``True``: any JSON
    object, by constrained decoding, ``mlxvlm.sampling.constrained``), ``sampler``,
    ``logits_processors``, ``prompt_progress_callback`` and ``prefill_step_size``.

    ``audio_output=True`` (a model that speaks: Qwen3-Omni's full checkpoint) also speaks
    the answer while it is written: results with ``audio`` set (token None, text "")
    carry each waveform chunk as the codec decodes it, float32 mono at ``sample_rate``,
    between the text's results and after its last one (which has ``finish_reason``); the
    stream's last result has ``speech`` (codes, voice, timing). ``voice``: the
    checkpoint's speaker names, any case (None: its default). ``talker_temperature`` 0:
    argmax for the talker and its code predictor, no repetition penalty; None: the
    checkpoint's own sampling; a ``seed`` makes the talker's sampled codes reproducible
    too. ``talker_max_frames``: the most codec frames spoken (12.5 a second for
    Qwen3-Omni).
    """
    check_generates(model)
    speech = SpeechRequest(voice, talker_temperature, talker_max_frames)
    if not audio_output and speech != SpeechRequest():
        raise MlxvlmError("voice, talker_temperature and talker_max_frames need "
                          "audio_output=True")
    objects = dict(sampling=sampling, cache=cache, media=media, speculation=speculation)
    folded = fold_keywords("stream_generate", objects, kwargs)
    plain = folded.plain
    if sampling is not None:
        if max_tokens is not None:
            raise TypeError("stream_generate() got both sampling= and max_tokens=: set "
                            "max_tokens on the SamplingOptions instead")
        # A copy: the grammar below is set on it, and the caller may reuse theirs.
        options = build_options(SamplingOptions, dataclasses.replace(sampling), {})
    else:
        options = sampling_options(processor, max_tokens=256 if max_tokens is None else max_tokens,
                                   **folded.grouped["sampling"])
    json_schema = plain["json_schema"]
    if json_schema is not None and json_schema is not False:
        options.constraint = json_schema_constraint(
            tokenizer_of(processor), eos_token_ids(processor),
            None if json_schema is True else json_schema)
    prefill_step_size = plain["prefill_step_size"]
    if prefill_step_size < 1:
        raise MlxvlmError(f"prefill_step_size must be at least 1, got {prefill_step_size}")
    cache_options = build_options(CacheOptions, cache, folded.grouped["cache"])
    media = build_options(MediaOptions, media, folded.grouped["media"])
    speculation = build_options(SpeculationOptions, speculation, folded.grouped["speculation"])
    if audio_output:
        check_speech_request(model, speech, {"speculation": speculation})

    start = time.perf_counter()
    mx.reset_peak_memory()

    def prepare(target_processor: Any, target: nn.Module, max_context: int | None = None):
        return prepare_inputs(
            target_processor, prompt, image, video=video, audio=audio, system=plain["system"],
            raw_prompt=plain["raw_prompt"], feature_names=getattr(target, "feature_names", None),
            media_policy=media.media_policy, video_options=media.video_options(),
            chat_template_kwargs=plain["chat_template_kwargs"], max_context=max_context)

    # A rotating cache (max_kv_size) takes prompts longer than the context.
    unbounded = cache_options.max_kv_size is not None
    inputs = prepare(processor, model, None if unbounded else model.max_context)
    yield from generate_prepared(
        model, processor, inputs, options, cache_options, prefill_step_size=prefill_step_size,
        sampler=plain["sampler"], logits_processors=plain["logits_processors"],
        prompt_progress_callback=plain["prompt_progress_callback"], start=start,
        fit_context=not unbounded, speculation=speculation, prepare_draft_inputs=prepare,
        speech=speech if audio_output else None,
    )


def generate_prepared(
    model: nn.Module,
    processor: Any,
    inputs: PreparedInputs,
    options: SamplingOptions,
    cache_options: CacheOptions,
    *,
    prefill_step_size: int = 2048,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: Sequence[Callable] | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    start: float | None = None,
    fit_context: bool = True,
    job: GenerationJob | None = None,
    speculation: SpeculationOptions | None = None,
    prepare_draft_inputs: Callable | None = None,
    speech: SpeechRequest | None = None,
) -> Generator[GenerationResult, None, None]:
    """``stream_generate`` from its prepared inputs and resolved options on. On rank 0 of
    a sharded model it runs the towers and sends the other ranks the job first; they come
    here with that ``job`` (``mlxvlm.generate.follower``). ``prepare_draft_inputs(
    processor, draft)``: the prompt as a draft model's own processor prepares it.
    ``speech``: the answer spoken as it is written (``stream_generate``'s audio_output)."""
    start = time.perf_counter() if start is None else start
    written = _written(model, processor, inputs, options, cache_options,
                       prefill_step_size=prefill_step_size, sampler=sampler,
                       logits_processors=logits_processors,
                       prompt_progress_callback=prompt_progress_callback, start=start,
                       fit_context=fit_context, job=job, speculation=speculation,
                       prepare_draft_inputs=prepare_draft_inputs)
    if speech is None:
        yield from written
    else:
        yield from _spoken(model, processor, inputs, options, speech, start, written)


def _spoken(model, processor, inputs: PreparedInputs, options: SamplingOptions,
            speech: SpeechRequest, start: float, written) -> Generator[GenerationResult, None, None]:
    """The text's results interleaved with the speech's: after each token, the chunks
    the talker and codec decode from what the thinker has fed so far; the rest once the
    answer is complete. Stopping the stream (the caller closes it, an exception) stops
    every stage and frees their caches."""
    check_speech_request(model, speech, {})
    with thinker_states(model) as tap:
        speaker = AnswerSpeaker(model, tap, inputs.num_tokens, eos_token_ids(processor),
                                voice=speech.voice, talker_temperature=speech.talker_temperature,
                                max_frames=speech.talker_max_frames, seed=options.seed,
                                started=start)
        try:
            last = None
            for last in written:
                yield last
                for chunk in speaker.wrote(last.token, last.finish_reason is not None):
                    yield _audio_result(last, chunk, speaker)
            if last is None:
                raise MlxvlmError("there is no answer to speak (no tokens were generated)")
            pending = None
            for chunk in speaker.finish():
                if pending is not None:
                    yield pending
                pending = _audio_result(last, chunk, speaker)
            final = pending or _audio_result(last, np.zeros(0, np.float32), speaker)
            final.speech = speaker.speech
            yield final
        finally:
            written.close()
            speaker.close()


def _audio_result(last: GenerationResult, chunk: np.ndarray,
                  speaker: AnswerSpeaker) -> GenerationResult:
    return dataclasses.replace(last, text="", token=None, logprobs=None, finish_reason=None,
                               logprob=None, top_logprobs=None, stop_string=None,
                               audio=chunk, sample_rate=speaker.speech.sample_rate)


def _written(
    model: nn.Module,
    processor: Any,
    inputs: PreparedInputs,
    options: SamplingOptions,
    cache_options: CacheOptions,
    *,
    prefill_step_size: int,
    sampler: Callable[[mx.array], mx.array] | None,
    logits_processors: Sequence[Callable] | None,
    prompt_progress_callback: Callable[[int, int], None] | None,
    start: float,
    fit_context: bool,
    job: GenerationJob | None,
    speculation: SpeculationOptions | None,
    prepare_draft_inputs: Callable | None,
) -> Generator[GenerationResult, None, None]:
    """The answer's text, step by step."""
    speculates = speculation is not None and speculation.enabled
    if speculates and model.sharding is not None:
        raise MlxvlmError("speculative decoding does not run in a sharded model's generate "
                          "yet: leave out --draft-model, --prompt-lookup-num-tokens and --mtp "
                          "(the sharded server speculates, with --max-concurrency 1)")
    tokenizer = generation_tokenizer(processor)
    eos_ids = eos_token_ids(processor)
    prompt_tokens = inputs.num_tokens
    max_tokens = job.max_tokens if job is not None else options.max_tokens
    if fit_context and job is None:
        max_tokens = fit_to_context(model, prompt_tokens, max_tokens)
    embedded = None if job is None else (job.embeddings, job.state)
    if job is None and leads(model):
        embedded = embed_prompt(model, inputs.input_ids, **inputs.features)
        announce(model, GenerationJob(inputs.input_ids, *embedded, options, cache_options,
                                      max_tokens, prefill_step_size))

    cache = cache_options.make(model, inputs)
    row = RowSampler(options, inputs.input_ids[0], sampler=sampler, processors=logits_processors)
    text = SequenceText(tokenizer, eos_ids, options.stop, max_tokens, options.kept_token_ids)
    loop_options = dict(
        cache=cache, max_tokens=max_tokens, row=row, prefill_step_size=prefill_step_size,
        quantize=cache_options.quantize, prompt_progress_callback=prompt_progress_callback,
    )
    stats = None
    if speculates:
        speculation.validate()
        check_speculation(options, sampler, speculation.drafted)
        drafter = make_drafter(
            model, inputs, options, draft_model=speculation.draft_model,
            prompt_lookup=speculation.prompt_lookup_num_tokens is not None,
            mtp=speculation.mtp, prepare_draft_inputs=prepare_draft_inputs,
            prefill_step_size=prefill_step_size, target_processor=processor,
        )
        stats = SpeculationStats()
        tokens = speculative_tokens(model, inputs, options=options, drafter=drafter,
                                    num_draft_tokens=speculation.drafted, stats=stats,
                                    **loop_options)
    else:
        tokens = generate_tokens(model, inputs, embedded=embedded, **loop_options)

    prompt_tps = 0.0
    decode_start = start
    steps = peer_checked(model, tokens)
    for n, (token, logprobs) in enumerate(steps):
        if n == 0:
            decode_start = time.perf_counter()
            prompt_tps = prompt_tokens / (decode_start - start)
        segment, finish_reason = text.add(token)
        elapsed = time.perf_counter() - decode_start
        result = GenerationResult(
            text=segment,
            token=token,
            logprobs=logprobs,
            prompt_tokens=prompt_tokens,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
            speculation=stats,
            stop_string=text.stop_string,
        )
        if options.top_logprobs is not None:
            values = np.asarray(logprobs.astype(mx.float32))
            result.logprob, result.top_logprobs = token_logprobs(
                values, token, options.top_logprobs)
        yield result
        if finish_reason is not None:
            # Closed now rather than whenever it is collected: on a sharded model this
            # finishes the step the loop scheduled ahead, before the group's next
            # collective (see generate_tokens), and a rank lost then is raised here.
            steps.close()
            break


def generate(model: nn.Module, processor: Any, prompt, image: Any = None,
             **kwargs) -> GenerationOutput:
    """Generate the whole answer; same arguments as ``stream_generate``.

    With ``audio_output=True`` the answer is also spoken (as it is written, see
    ``stream_generate``): ``.audio`` (float32 mono, the chunks joined), ``.sample_rate``,
    ``.audio_codes`` ((frames, code groups) for Qwen3-Omni, (frames,) for Qwen2.5-Omni),
    ``.voice``, ``.time_to_first_audio`` (seconds from the call's start) and
    ``.speech_seconds`` (the talker and codec's own). Voices are the checkpoint's speaker
    names: any case for Qwen3-Omni, exactly for Qwen2.5-Omni, as transformers matches
    them. ``talker_max_frames``: the most codec frames spoken (12.5 a second for
    Qwen3-Omni, 50 for Qwen2.5-Omni)."""
    folder = OutputFolder()
    speech = None
    for result in stream_generate(model, processor, prompt, image, **kwargs):
        if result.token is None:  # speech only
            speech = result.speech or speech
            continue
        folder.add(result)
        output = folder.output
        output.prompt_tps = result.prompt_tps
        output.generation_tps = result.generation_tps
        output.peak_memory = result.peak_memory
    output = folder.result()
    if speech is not None:
        output.audio, output.sample_rate = speech.audio, speech.sample_rate
        output.audio_codes, output.voice = speech.codes, speech.voice
        output.time_to_first_audio = speech.first_audio_seconds
        output.speech_seconds = speech.seconds
    return output
