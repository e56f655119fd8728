"""Anthropic's Messages API over the chat machinery: a ``MessagesRequest`` as the
``ChatCompletionRequest`` it means, and generated steps as Anthropic's message body or
its stream of named events (``message_start`` ... ``message_stop``)."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, AsyncIterator

from mlxvlm.batching import BatchStep
from mlxvlm.server.answering import steps, stream_failure
from mlxvlm.server.errors import ANTHROPIC_PATH, error_body
from mlxvlm.server.messages_schemas import MessagesRequest
from mlxvlm.server.schemas import ChatCompletionRequest
from mlxvlm.server.service import TokenStream

logger = logging.getLogger("mlxvlm.server")


def warn_unknown_fields(request: MessagesRequest) -> None:
    unknown = sorted(request.model_extra or {})
    if unknown:
        logger.warning("ignoring request fields this server does not support: %s",
                       ", ".join(unknown))


def _part(block: Any) -> dict[str, Any]:
    if block.type == "text":
        return {"type": "text", "text": block.text}
    source = block.source
    if source.type == "base64":
        url = f"data:{source.media_type};base64,{source.data}"
    else:
        url = source.url
    return {"type": "image_url", "image_url": {"url": url}}


def to_chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The same conversation and options as a chat completions request (so that both
    endpoints give the same answer to the same conversation)."""
    messages: list[dict[str, Any]] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else "\n".join(
            block.text for block in request.system)
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        content = message.content if isinstance(message.content, str) else [
            _part(block) for block in message.content]
        messages.append({"role": message.role, "content": content})
    return ChatCompletionRequest.model_validate({
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "stop": request.stop_sequences,
        "stream": request.stream,
    })


def stop_reason(last: BatchStep) -> str:
    if last.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if last.stop_string is not None else "end_turn"


def _usage(last: BatchStep) -> dict[str, int]:
    # Anthropic counts the prompt tokens read from the cache apart from the others.
    return {
        "input_tokens": last.prompt_tokens - last.cached_tokens,
        "cache_read_input_tokens": last.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": last.generation_tokens,
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class MessageWriter:
    """One answer's id and model, as Anthropic's body or its events."""

    def __init__(self, model_id: str):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model_id

    def _message(self, content: list[dict], last: BatchStep | None,
                 usage: dict[str, int]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None if last is None else stop_reason(last),
            "stop_sequence": None if last is None else last.stop_string,
            "usage": usage,
        }

    async def body(self, first: BatchStep, stream: TokenStream) -> dict[str, Any]:
        texts = []
        async for step in steps(first, stream):
            texts.append(step.text)
        return self._message([{"type": "text", "text": "".join(texts)}], step, _usage(step))

    async def events(self, first: BatchStep, stream: TokenStream) -> AsyncIterator[str]:
        start_usage = dict(_usage(first), output_tokens=0)
        yield _event("message_start", {"type": "message_start",
                                       "message": self._message([], None, start_usage)})
        yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}})
        yield _event("ping", {"type": "ping"})
        try:
            async for step in steps(first, stream):
                if step.text:
                    yield _event("content_block_delta", {
                        "type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": step.text}})
        except Exception as error:  # headers are sent: the failure goes as an error event
            logger.exception("generation failed while streaming")
            yield _event("error", error_body(*stream_failure(error), path=ANTHROPIC_PATH))
            return
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield _event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(step), "stop_sequence": step.stop_string},
            "usage": {"output_tokens": step.generation_tokens}})
        yield _event("message_stop", {"type": "message_stop"})
