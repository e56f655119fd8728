"""Spoken answers on chat completions (``"modalities": ["text", "audio"]``) and text said
on ``/v1/audio/speech``: the checks that answer 400 before a request is admitted, the
answer written and spoken through the batching engine, OpenAI's ``message.audio``.

A spoken answer is a row of the engine like any other request (``batching.spoken_rows``):
its thinker decodes in the batch beside the others, a tap of its own records the states
its talker reads, and the talker follows the thinker token by token, stepping once per
engine iteration with the other answers being spoken. Its stream holds the text's steps
and the codec's chunks in the order they were made (a streamed answer's text and audio
deltas interleave), and ends with its whole speech. It reuses the prompt prefix an
earlier spoken answer left (whose cache entry keeps the thinker states its talker reads;
a text answer's entry does not) and never speculates.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from mlxvlm.batching import BatchAudio, BatchStep
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.speech import DEFAULT_MAX_FRAMES, SpeechRequest, check_speech_request
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.sampling import SamplingOptions
from mlxvlm.server.answering import as_api_error, stream_failure
from mlxvlm.server.chat_completions import SSE_DONE, CompletionWriter, sse, to_messages
from mlxvlm.server.errors import APIError, error_body
from mlxvlm.server.lifetime import RequestLifetime
from mlxvlm.server.schemas import AudioOutput, ChatCompletionRequest
from mlxvlm.server.service import GenerationService, TokenStream
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


async def _submitted(life: RequestLifetime, service: GenerationService, messages: list[dict],
                     template_options: Any, options: SamplingOptions, speech: SpeechRequest,
                     param: str, plan: AnswerPlan | None = None
                     ) -> tuple[BatchStep | BatchAudio, TokenStream]:
    """``messages`` prepared and submitted to the engine to be spoken; returns once the
    first item came (so that a request failing before it gets its error status), with the
    stream of the rest."""
    try:
        prepared = await life.until_disconnect(
            service.prepare(messages, None, template_options))
        if plan is not None:
            plan.prompt_text = prepared.inputs.prompt_text
        stream = life.submit(prepared, options, speech)
        first = await life.until_disconnect(stream.__anext__())
    except (MlxvlmError, ValueError, TemplateError) as error:
        limit = getattr(error, "limit", None)  # a refusal for passing a limit
        if limit is not None:
            service.counters.refuse(limit)
        raise as_api_error(error, param) from error
    return first, stream


async def spoken_items(first: BatchStep | BatchAudio,
                       stream: TokenStream) -> AsyncIterator[BatchStep | BatchAudio]:
    """A spoken request's items from its first to its last (the one with its speech)."""
    item = first
    while True:
        yield item
        if isinstance(item, BatchAudio) and item.speech is not None:
            return
        item = await stream.__anext__()


async def whole_spoken(first: BatchStep | BatchAudio,
                       stream: TokenStream) -> tuple[str, BatchStep, Speech]:
    """The answer's text, its last step and its speech."""
    texts, last, speech = [], None, None
    async for item in spoken_items(first, stream):
        if isinstance(item, BatchStep):
            texts.append(item.text)
            last = item
        else:
            speech = item.speech or speech
    return "".join(texts), last, speech


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
    with RequestLifetime(service, request) as life:
        first, stream = await _submitted(life, service, messages, plan.template_options,
                                         options, speech, "messages", plan)
        if chat.stream:
            include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
            return life.event_stream(_spoken_events(writer, plan, first, stream,
                                                    include_usage))
        try:
            text, last, spoken = await life.until_disconnect(whole_spoken(first, stream))
        except (MlxvlmError, ValueError) as error:
            raise as_api_error(error) from error
    splitter = plan.splitter()
    parts = splitter.feed(text) + splitter.finish()
    content = "".join(p.text for p in parts if p.kind == "content")
    message: dict[str, Any] = {"content": content,
                               "audio": message_audio(spoken, audio.format, content)}
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    if reasoning:
        message["reasoning_content"] = reasoning
    return JSONResponse(writer.body(message, last.finish_reason, last, None))


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
        first, stream = await _submitted(life, service, messages, None, options, speech,
                                         "input")
        if body.response_format == "pcm":
            return life.byte_stream(_said_bytes(first, stream), MEDIA_TYPES["pcm"])
        try:
            _, _, spoken = await life.until_disconnect(whole_spoken(first, stream))
        except (MlxvlmError, ValueError) as error:
            raise as_api_error(error, "input") from error
    return Response(content=audio_bytes(spoken, "wav"), media_type=MEDIA_TYPES["wav"])


async def _said_bytes(first: BatchStep | BatchAudio, stream: TokenStream) -> AsyncIterator[bytes]:
    try:
        async for item in spoken_items(first, stream):
            if isinstance(item, BatchAudio) and len(item.chunk):
                yield pcm16(item.chunk)
    except Exception:  # the status is sent: the stream breaks off, unterminated
        logger.exception("speech failed while streaming")
        raise


async def _spoken_events(writer: CompletionWriter, plan: AnswerPlan,
                         first: BatchStep | BatchAudio, stream: TokenStream,
                         include_usage: bool) -> AsyncIterator[str]:
    """A streamed spoken answer: the text as it is written (``content`` and
    ``audio.transcript`` deltas) and, while it is, the audio as the codec decodes it
    (``audio.data``: base64 pcm16 chunks), in the order they were made, as OpenAI's audio
    models stream."""
    audio_id = f"audio_{uuid.uuid4().hex}"
    splitter = plan.splitter()
    last = None
    try:
        yield writer.chunk({"role": "assistant", "content": ""},
                           include_usage=include_usage)
        async for item in spoken_items(first, stream):
            if isinstance(item, BatchStep):
                last = item
                parts = splitter.feed(item.text)
                if item.finish_reason is not None:
                    parts += splitter.finish()
                for part in parts:
                    if part.kind == "reasoning":
                        delta = {"reasoning_content": part.text}
                    else:
                        delta = {"content": part.text,
                                 "audio": {"id": audio_id, "transcript": part.text}}
                    yield writer.chunk(delta, include_usage=include_usage)
            elif len(item.chunk):
                data = base64.b64encode(pcm16(item.chunk)).decode("ascii")
                yield writer.chunk({"audio": {"id": audio_id, "data": data}},
                                   include_usage=include_usage)
    except Exception as error:  # headers are sent: the failure goes as an error event
        logger.exception("a spoken answer failed while streaming")
        yield sse(error_body(*stream_failure(error)))
        return
    yield writer.chunk({"audio": {"id": audio_id, "expires_at": int(time.time())
                                  + AUDIO_LIFETIME_SECONDS}},
                       finish_reason=last.finish_reason, include_usage=include_usage)
    if include_usage:
        yield writer.usage_chunk(last)
    yield SSE_DONE
