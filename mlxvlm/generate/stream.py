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
from mlxvlm.generate.speech import (SpeechRequest, check_speech_request, speak_answer,
                                    thinker_states)
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
    """
    check_generates(model)
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
) -> Generator[GenerationResult, None, None]:
    """``stream_generate`` from its prepared inputs and resolved options on. On rank 0 of
    a sharded model it runs the towers and sends the other ranks the job first; they come
    here with that ``job`` (``mlxvlm.generate.follower``). ``prepare_draft_inputs(
    processor, draft)``: the prompt as a draft model's own processor prepares it."""
    speculates = speculation is not None and speculation.enabled
    if speculates and model.sharding is not None:
        raise MlxvlmError("speculative decoding does not run in a sharded model's generate "
                          "yet: leave out --draft-model, --prompt-lookup-num-tokens and --mtp "
                          "(the sharded server speculates, with --max-concurrency 1)")
    start = time.perf_counter() if start is None else start
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
            prefill_step_size=prefill_step_size,
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


def generate(model: nn.Module, processor: Any, prompt, image: Any = None, *,
             audio_output: bool = False, voice: str | None = None,
             talker_temperature: float | None = None, talker_max_frames: int = 4096,
             **kwargs) -> GenerationOutput:
    """Generate the whole answer; same arguments as ``stream_generate``.

    ``audio_output=True`` (a model that speaks: Qwen3-Omni's or Qwen2.5-Omni's full
    checkpoint) also speaks the answer once it is written: ``.audio`` (float32 mono),
    ``.sample_rate``, ``.audio_codes`` ((frames, code groups) for Qwen3-Omni, (frames,)
    for Qwen2.5-Omni), in ``voice`` (the checkpoint's speaker names: any case for
    Qwen3-Omni, exactly for Qwen2.5-Omni, as transformers matches them; None: its
    default). ``talker_temperature`` 0: argmax for the talker (and Qwen3-Omni's code
    predictor), no repetition penalty; None: the checkpoint's own sampling.
    ``talker_max_frames``: the most codec frames spoken (12.5 a second for Qwen3-Omni, 50
    for Qwen2.5-Omni)."""
    request = SpeechRequest(voice, talker_temperature, talker_max_frames)
    if not audio_output:
        if request != SpeechRequest():
            raise MlxvlmError("voice, talker_temperature and talker_max_frames need "
                              "audio_output=True")
        return _generate_text(model, processor, prompt, image, **kwargs)
    start = time.perf_counter()
    check_speech_request(model, request, kwargs)
    with thinker_states(model) as tap:
        output = _generate_text(model, processor, prompt, image, **kwargs)
    speech, output.time_to_first_audio = speak_answer(
        model, processor, tap, output.prompt_tokens, output.tokens, request, start)
    output.audio, output.sample_rate = speech.audio, speech.sample_rate
    output.audio_codes, output.voice = speech.codes, speech.voice
    output.speech_seconds = speech.seconds
    return output


def _generate_text(model: nn.Module, processor: Any, prompt, image: Any = None,
                   **kwargs) -> GenerationOutput:
    folder = OutputFolder()
    for result in stream_generate(model, processor, prompt, image, **kwargs):
        folder.add(result)
        output = folder.output
        output.prompt_tps = result.prompt_tps
        output.generation_tps = result.generation_tps
        output.peak_memory = result.peak_memory
    return folder.result()
