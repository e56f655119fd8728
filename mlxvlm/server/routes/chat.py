"""``POST /v1/chat/completions``: a validated request through admission, preparation and
the engine to OpenAI's body or its stream of chunks, within one ``RequestLifetime``."""

from __future__ import annotations

import asyncio
from typing import Annotated, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from mlxvlm.batching import BatchStep
from mlxvlm.text.answer_parts import AnswerSplitter, Part
from mlxvlm.server.answering import (
    answer,
    logged_stream_failure,
    plan_answer,
    split_steps,
    steps,
)
from mlxvlm.server.chat_completions import (
    SSE_DONE,
    CompletionWriter,
    sse,
)
from mlxvlm.server.deps import chat_request, chat_service, get_token_bytes
from mlxvlm.server.errors import APIError, error_body
from mlxvlm.server.logprobs import TokenBytes, logprob_content
from mlxvlm.server.schemas import ChatCompletionRequest
from mlxvlm.server.service import GenerationService, TokenStream
from mlxvlm.server.speech import answer_spoken
from mlxvlm.server.tools import AnswerPlan
from mlxvlm.text.doctags import (
    DocTagsError,
    answers_in_doctags,
    check_answers_in_doctags,
    doctags_token_ids,
)
from mlxvlm.text.doctags import convert as convert_doctags


router = APIRouter()


Body = Annotated[ChatCompletionRequest, Depends(chat_request)]
Service = Annotated[GenerationService, Depends(chat_service)]
Bytes = Annotated[TokenBytes, Depends(get_token_bytes)]


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, chat: Body, service: Service,
                           token_bytes: Bytes) -> Response:
    options, plan = plan_answer(chat, service)
    if chat.output_format is not None:
        options.kept_token_ids = options.kept_token_ids | doctags_ids(chat, service)
    writer = CompletionWriter(service.config.model_id)
    if chat.speaks:
        return await answer_spoken(request, chat, options, plan, service, writer)
    include_usage = bool(chat.stream_options and chat.stream_options.include_usage)

    async def body(first: BatchStep, stream: TokenStream):
        answer = await _collect(token_bytes, writer, plan, first, stream, chat.logprobs)
        if chat.output_format not in (None, "doctags"):
            message = answer["choices"][0]["message"]
            # docling-core's conversion is CPU work: not on the event loop
            message["content"] = await asyncio.to_thread(
                convert_doctags, (message["content"] or "").strip(), chat.output_format)
        return answer

    def events(first: BatchStep, stream: TokenStream):
        return _stream_events(token_bytes, writer, plan, first, stream, include_usage,
                              chat.logprobs)

    return await answer(request, chat, options, service, body=body, events=events,
                        plan=plan)


def doctags_ids(chat: ChatCompletionRequest, service: GenerationService) -> frozenset[int]:
    """The tags a DocTags answer keeps; a 400 for a model that does not answer in DocTags,
    a 501 where the server lacks docling-core for a conversion."""
    try:
        check_answers_in_doctags(service.processor, chat.output_format, "output_format")
    except DocTagsError as error:
        if answers_in_doctags(service.processor):  # docling-core is missing
            raise APIError(501, str(error), param="output_format") from None
        raise APIError(400, str(error), param="output_format") from None
    return doctags_token_ids(service.processor)


def _finish_reason(last: BatchStep, splitter: AnswerSplitter) -> str | None:
    return "tool_calls" if splitter.calls and last.finish_reason == "stop" else last.finish_reason


async def _collect(token_bytes: TokenBytes, writer: CompletionWriter, plan: AnswerPlan,
                   first: BatchStep, stream: TokenStream, want_logprobs: bool | None) -> dict:
    texts, logprobs = [], []
    async for step in steps(first, stream):
        texts.append(step.text)
        if want_logprobs:
            logprobs.append(logprob_content(token_bytes, step))
    splitter = plan.splitter()
    parts = splitter.feed("".join(texts)) + splitter.finish()
    content = "".join(p.text for p in parts if p.kind == "content")
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    message: dict = {"content": content if content or not splitter.calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if splitter.calls:
        message["tool_calls"] = [call.openai() for call in splitter.calls]
    return writer.body(message, _finish_reason(step, splitter), step,
                       logprobs if want_logprobs else None)


def _deltas(parts: list[Part], splitter: AnswerSplitter) -> list[dict]:
    deltas = []
    for part in parts:
        if part.kind == "tool_call":
            index = splitter.calls.index(part.call)
            deltas.append({"tool_calls": [part.call.openai(index)]})
        elif part.kind == "reasoning":
            deltas.append({"reasoning_content": part.text})
        else:
            deltas.append({"content": part.text})
    return deltas


async def _stream_events(token_bytes: TokenBytes, writer: CompletionWriter, plan: AnswerPlan,
                         first: BatchStep, stream: TokenStream, include_usage: bool,
                         want_logprobs: bool | None) -> AsyncIterator[str]:
    yield writer.chunk({"role": "assistant", "content": ""}, include_usage=include_usage)
    splitter = plan.splitter()
    try:
        async for step, parts in split_steps(first, stream, splitter):
            logprobs = [logprob_content(token_bytes, step)] if want_logprobs else None
            deltas = _deltas(parts, splitter)
            if logprobs and not deltas:
                deltas = [{"content": ""}]
            for n, delta in enumerate(deltas):
                yield writer.chunk(delta, logprobs=logprobs if n == 0 else None,
                                   include_usage=include_usage)
    except Exception as error:  # headers are sent: the failure goes as an error event
        yield sse(error_body(*logged_stream_failure(error)))
        return
    yield writer.chunk({}, finish_reason=_finish_reason(step, splitter),
                       include_usage=include_usage)
    if include_usage:
        yield writer.usage_chunk(step)
    yield SSE_DONE
