"""Spoken answers on chat completions (``"modalities": ["text", "audio"]``) and text said
on ``/v1/audio/speech``: the checks that answer 400 before a request is admitted, the
answer written and spoken with the model held alone, OpenAI's ``message.audio``.

A spoken answer does not go through the batching engine: the talker reads the thinker's
hidden states of this one request, and the state tap (``generate.speech.thinker_states``)
records every pass of the model, so the answer is written by ``generate``'s own loop while
the engine steps no batch (``GenerationService.run_alone``), and spoken as it is written
(the talker follows the thinker token by token, ``speech.pipeline.AnswerSpeaker``): a
streamed answer's text and audio deltas alternate. Spoken answers therefore run one at a
time, and other requests' decoding pauses while one runs.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.speech import DEFAULT_MAX_FRAMES, SpeechRequest, check_speech_request
from mlxvlm.generate.spoken_answer import SpokenAnswer
from mlxvlm.generate.spoken_answer import write_and_speak as write_and_speak_alone
from mlxvlm.generate.stream import GenerationResult
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.sampling import SamplingOptions
from mlxvlm.server.answering import as_api_error, stream_failure
from mlxvlm.server.chat_completions import SSE_DONE, CompletionWriter, sse, to_messages
from mlxvlm.server.errors import APIError, error_body
from mlxvlm.server.lifetime import RequestLifetime
from mlxvlm.server.schemas import AudioOutput, ChatCompletionRequest
from mlxvlm.server.service import GenerationService, PreparedRequest
from mlxvlm.server.speech_schemas import SpeechBody
from mlxvlm.server.tools import AnswerPlan
from mlxvlm.speech.duration import frames_within
from mlxvlm.speech.forced_answer import ForcedAnswer
from mlxvlm.speech.pipeline import Speech, check_speaks, speech_voice
from mlxvlm.speech.wav import pcm16, wav_bytes

logger = logging.getLogger("mlxvlm.server")

# What /v1/audio/speech answers with, by response_format
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}

# The user's turn of /v1/audio/speech; the assistant's turn is the input itself, forced
# (speech.forced_answer), so that the words said are the input's whatever the model.
SAY_REQUEST = "Say the following text exactly as it is written, and nothing else:\n\n{text}"

# How long a client may refer to an answer's audio by its id, as OpenAI's expires_at
# says (this server keeps no audio: the field is for clients that read it).
AUDIO_LIFETIME_SECONDS = 3600


def speech_request(service: GenerationService, voice: str | None,
                   talker_temperature: float | None, talker_max_frames: int | None, *,
                   voice_param: str,
                   modality_param: str = "modalities") -> SpeechRequest:
    """The request's speech, or a 400: a model that does not speak (``modality_param``),
    an unknown voice (``voice_param``, the message naming the voices), more frames than
    ``--max-speech-seconds`` allows. Frames left out: the model's default, clamped to
    that bound."""
    model = service.model
    try:
        check_speaks(model)
        if model.sharding is not None:
            raise MlxvlmError("audio output does not run on a sharded model")
    except MlxvlmError as error:
        raise APIError(400, str(error), param=modality_param) from None
    try:
        speech_voice(model, voice)
    except MlxvlmError as error:
        raise APIError(400, str(error), param=voice_param) from None
    seconds = service.config.max_speech_seconds
    limit = frames_within(model, seconds)
    if talker_max_frames is not None and talker_max_frames > limit:
        service.counters.refuse("max_speech_seconds")
        raise APIError(400, f"talker_max_frames {talker_max_frames} asks for more speech "
                       f"than this server gives: at most {limit} frames ({seconds:g} s of "
                       "audio, the server's --max-speech-seconds)",
                       param="talker_max_frames")
    request = SpeechRequest(voice, talker_temperature,
                            talker_max_frames or min(DEFAULT_MAX_FRAMES, limit))
    check_speech_request(model, request, {})
    return request


def write_and_speak(service: GenerationService, options: SamplingOptions,
                    request: SpeechRequest, prepared: PreparedRequest,
                    on_step: Callable[[GenerationResult], None] | None = None,
                    on_audio: Callable[[np.ndarray], None] | None = None) -> SpokenAnswer:
    """With the model held alone (``service.run_alone``'s work): the answer written,
    then spoken (``generate.spoken_answer``); stops at the next token or frame if the
    client went away."""
    def step(result: GenerationResult) -> None:
        if result.finish_reason is not None:
            logger.info("speaking a %d-token answer (at most %d frames)",
                        result.generation_tokens, request.talker_max_frames)
        if on_step is not None:
            on_step(result)

    return write_and_speak_alone(service.model, service.processor, prepared.inputs, options,
                                 request, prefill_step_size=service.config.prefill_step_size,
                                 on_step=step, on_audio=on_audio)


def audio_bytes(speech: Speech, fmt: str) -> bytes:
    """``wav``: a 16-bit mono WAV file; ``pcm16``/``pcm``: its raw little-endian samples
    at the model's rate."""
    if fmt == "wav":
        return wav_bytes(speech.audio, speech.sample_rate)
    return pcm16(speech.audio)


def message_audio(speech: Speech, fmt: str, transcript: str) -> dict[str, Any]:
    """OpenAI's ``choices[0].message.audio``."""
    return {
        "id": f"audio_{uuid.uuid4().hex}",
        "data": base64.b64encode(audio_bytes(speech, fmt)).decode("ascii"),
        "expires_at": int(time.time()) + AUDIO_LIFETIME_SECONDS,
        "transcript": transcript,
    }


async def answer_spoken(request: Request, chat: ChatCompletionRequest, options: SamplingOptions,
                        plan: AnswerPlan, service: GenerationService,
                        writer: CompletionWriter) -> Response:
    """A chat completion with ``modalities`` ["text", "audio"]: the body with
    ``message.audio`` beside ``content`` (the transcript)."""
    audio = chat.audio or AudioOutput()
    speech = speech_request(service, audio.voice, chat.talker_temperature,
                            chat.talker_max_frames, voice_param="audio.voice")
    if chat.stream and audio.format != "pcm16":
        raise APIError(400, "streamed audio is pcm16 (as OpenAI streams it): send audio "
                       "format pcm16, or stream false", param="audio.format")
    if chat.tools or chat.response_format is not None:
        raise APIError(400, "audio output does not take tools or a response_format",
                       param="modalities")
    if chat.logprobs:
        raise APIError(400, "audio output gives no logprobs", param="logprobs")
    messages = plan.conversation(to_messages(chat))
    if chat.stream:
        return await _stream_spoken(request, chat, options, plan, service, writer, speech,
                                    messages)
    with RequestLifetime(service, request) as life:
        def work(prepared: PreparedRequest) -> SpokenAnswer:
            plan.prompt_text = prepared.inputs.prompt_text
            return write_and_speak(service, options, speech, prepared)

        try:
            spoken = await life.until_disconnect(
                service.run_alone(messages, plan.template_options, work))
        except (MlxvlmError, ValueError, TemplateError) as error:
            raise as_api_error(error) from error
    splitter = plan.splitter()
    parts = splitter.feed(spoken.text) + splitter.finish()
    content = "".join(p.text for p in parts if p.kind == "content")
    message: dict[str, Any] = {"content": content,
                               "audio": message_audio(spoken.speech, audio.format, content)}
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    if reasoning:
        message["reasoning_content"] = reasoning
    return JSONResponse(writer.body(message, spoken.finish_reason, spoken, None))


async def say(request: Request, body: SpeechBody, service: GenerationService) -> Response:
    """/v1/audio/speech: the input said in the voice asked for, as ``response_format``'s
    bytes: ``pcm`` streamed as the codec decodes it (chunked), ``wav`` whole (its header
    holds the length). The conversation is a user turn asking for the text to be said and
    the text as the assistant's answer, forced token by token (greedy, whatever the model
    would write), which the talker speaks as it is forced."""
    limit = service.config.max_speech_input_chars
    if len(body.input) > limit:
        service.counters.refuse("max_speech_input_chars")
        raise APIError(400, f"input holds {len(body.input)} characters; this server says at "
                       f"most {limit} at once (its --max-speech-input-chars)", param="input")
    speech = speech_request(service, body.voice, body.talker_temperature,
                            body.talker_max_frames, voice_param="voice", modality_param="model")
    forced = ForcedAnswer.of_text(service.processor, body.input,
                                  eos_token_ids(service.processor))
    options = SamplingOptions(max_tokens=len(forced.ids), extra_processors=(forced,),
                              seed=body.seed)
    messages = [{"role": "user", "content": SAY_REQUEST.format(text=body.input)}]
    with RequestLifetime(service, request) as life:
        if body.response_format == "pcm":
            first, queue, task = await _first_event(
                life, service, messages, None, "input",
                lambda prepared, put: write_and_speak(
                    service, options, speech, prepared,
                    on_audio=lambda samples: put("audio", samples)))
            return life.byte_stream(_said_bytes(first, queue, task), MEDIA_TYPES["pcm"])
        try:
            spoken = await life.until_disconnect(service.run_alone(
                messages, None,
                lambda prepared: write_and_speak(service, options, speech, prepared)))
        except (MlxvlmError, ValueError, TemplateError) as error:
            raise as_api_error(error, "input") from error
    return Response(content=audio_bytes(spoken.speech, "wav"), media_type=MEDIA_TYPES["wav"])


async def _first_event(life: RequestLifetime, service: GenerationService, messages: list[dict],
                       template_options: Any, param: str,
                       work: Callable[[PreparedRequest, Callable[[str, Any], None]], Any]):
    """``work(prepared, put)`` run with the model held alone, each ``put(kind, item)`` of
    it queued for the response; returns once the first is (so that a request failing
    before gets its error status), with the queue and the task (its end queued as
    ("done", None))."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(kind: str, item: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (kind, item))

    task = asyncio.ensure_future(service.run_alone(messages, template_options,
                                                   lambda prepared: work(prepared, put)))
    task.add_done_callback(lambda _: queue.put_nowait(("done", None)))
    try:
        first = await life.until_disconnect(queue.get())
        if first[0] == "done":
            task.result()  # its failure, before any header is sent
    except BaseException as error:  # a failure before the first item, or the client left
        task.cancel()
        if isinstance(error, (MlxvlmError, ValueError, TemplateError)):
            raise as_api_error(error, param) from error
        raise
    return first, queue, task


async def _said_bytes(first: tuple, queue: asyncio.Queue,
                      task: asyncio.Future) -> AsyncIterator[bytes]:
    item = first
    try:
        while item[0] != "done":
            yield pcm16(item[1])
            item = await queue.get()
        task.result()
    except Exception:  # the status is sent: the stream breaks off, unterminated
        logger.exception("speech failed while streaming")
        raise
    finally:
        task.cancel()  # the client left: the worker stops at its next token or chunk


async def _stream_spoken(request: Request, chat: ChatCompletionRequest,
                         options: SamplingOptions, plan: AnswerPlan,
                         service: GenerationService, writer: CompletionWriter,
                         speech: SpeechRequest, messages: list[dict]) -> Response:
    """A streamed spoken answer: the text as it is written (``content`` and
    ``audio.transcript`` deltas) and, while it is, the audio as the codec decodes it
    (``audio.data``: base64 pcm16 chunks), as OpenAI's audio models stream; the talker
    follows the thinker, so the two kinds of deltas alternate. The response starts once
    the first token is written, so that a request that fails before gets its error
    status."""
    def work(prepared: PreparedRequest, put) -> SpokenAnswer:
        plan.prompt_text = prepared.inputs.prompt_text
        return write_and_speak(service, options, speech, prepared,
                               on_step=lambda step: put("step", step),
                               on_audio=lambda samples: put("audio", samples))

    include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
    audio_id = f"audio_{uuid.uuid4().hex}"
    with RequestLifetime(service, request) as life:
        first, queue, task = await _first_event(life, service, messages, plan.template_options,
                                                "messages", work)
        return life.event_stream(_spoken_events(writer, plan, audio_id, first, queue, task,
                                                include_usage))


async def _spoken_events(writer: CompletionWriter, plan: AnswerPlan, audio_id: str,
                         first: tuple, queue: asyncio.Queue, task: asyncio.Future,
                         include_usage: bool) -> AsyncIterator[str]:
    splitter = plan.splitter()
    item = first
    try:
        yield writer.chunk({"role": "assistant", "content": ""},
                           include_usage=include_usage)
        while item[0] != "done":
            kind, value = item
            if kind == "step":
                parts = splitter.feed(value.text)
                if value.finish_reason is not None:
                    parts += splitter.finish()
                for part in parts:
                    if part.kind == "reasoning":
                        delta = {"reasoning_content": part.text}
                    else:
                        delta = {"content": part.text,
                                 "audio": {"id": audio_id, "transcript": part.text}}
                    yield writer.chunk(delta, include_usage=include_usage)
            else:
                data = base64.b64encode(pcm16(value)).decode("ascii")
                yield writer.chunk({"audio": {"id": audio_id, "data": data}},
                                   include_usage=include_usage)
            item = await queue.get()
        spoken = task.result()
    except Exception as error:  # headers are sent: the failure goes as an error event
        logger.exception("a spoken answer failed while streaming")
        yield sse(error_body(*stream_failure(error)))
        return
    finally:
        task.cancel()  # the client left: the worker stops at its next token or chunk
    yield writer.chunk({"audio": {"id": audio_id, "expires_at": int(time.time())
                                  + AUDIO_LIFETIME_SECONDS}},
                       finish_reason=spoken.finish_reason, include_usage=include_usage)
    if include_usage:
        yield writer.usage_chunk(spoken)
    yield SSE_DONE
