"""Anthropic's Messages API over the chat machinery: a ``MessagesRequest`` as the
``ChatCompletionRequest`` it means, and generated steps as Anthropic's message body or
its stream of named events (``message_start`` ... ``message_stop``)."""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from mlxvlm.batching import BatchStep
from mlxvlm.server.answering import logged_stream_failure, split_steps, whole_answer
from mlxvlm.text.answer_parts import Part, ToolCall
from mlxvlm.server.chat_completions import as_chat_request
from mlxvlm.server.errors import ANTHROPIC_PATH, error_body
from mlxvlm.server.anthropic_schemas import MessagesRequest
from mlxvlm.server.schemas import ChatCompletionRequest
from mlxvlm.server.service import TokenStream
from mlxvlm.server.tools import AnswerPlan


def _part(block: Any) -> dict[str, Any]:
    if block.type == "text":
        return {"type": "text", "text": block.text}
    source = block.source
    if block.type == "document":
        return {"type": "file", "file": {
            "file_data": f"data:{source.media_type};base64,{source.data}"}}
    if source.type == "base64":
        url = f"data:{source.media_type};base64,{source.data}"
    else:
        url = source.url
    return {"type": "image_url", "image_url": {"url": url}}


def _result_text(block: Any) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    return "\n".join(part.text for part in block.content if part.type == "text")


def _chat_messages(message: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat completions messages: tool results become tool
    messages (before the rest of the user's turn), calls an assistant's tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    results = [b for b in message.content if b.type == "tool_result"]
    calls = [b for b in message.content if b.type == "tool_use"]
    parts = [_part(b) for b in message.content if b.type in ("text", "image", "document")]
    messages = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)}
                for b in results]
    if calls:
        messages.append({"role": "assistant", "content": "".join(
            p["text"] for p in parts if p["type"] == "text") or None, "tool_calls": [
            {"id": b.id, "type": "function",
             "function": {"name": b.name, "arguments": json.dumps(b.input)}} for b in calls]})
    elif parts or not results:
        messages.append({"role": message.role, "content": parts})
    return messages


def _tool_choice(request: MessagesRequest) -> Any:
    choice = request.tool_choice  # its name checked by MessagesRequest
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def to_chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The same conversation and options as a chat completions request (so that both
    endpoints give the same answer to the same conversation)."""
    messages: list[dict[str, Any]] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else "\n".join(
            block.text for block in request.system)
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        messages += _chat_messages(message)
    template_kwargs = None
    if request.thinking is not None:
        template_kwargs = {"enable_thinking": request.thinking.type != "disabled"}
    return as_chat_request({
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "stop": request.stop_sequences,
        "stream": request.stream,
        "tools": [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in request.tools] if request.tools else None,
        "tool_choice": _tool_choice(request),
        "parallel_tool_calls": False if request.tool_choice is not None
        and request.tool_choice.disable_parallel_tool_use else None,
        "chat_template_kwargs": template_kwargs,
        "thinking_budget": request.thinking.budget_tokens
        if request.thinking is not None and request.thinking.type != "disabled" else None,
    })


def stop_reason(last: BatchStep, calls: bool = False) -> str:
    if last.finish_reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
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


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1),
            "name": call.name, "input": json.loads(call.arguments)}


def _blocks(parts: list[Part]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for part in parts:
        if part.kind == "tool_call":
            blocks.append(_tool_use(part.call))
        elif part.kind == "reasoning":
            if blocks and blocks[-1]["type"] == "thinking":
                blocks[-1]["thinking"] += part.text
            else:
                blocks.append({"type": "thinking", "thinking": part.text, "signature": ""})
        elif blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += part.text
        else:
            blocks.append({"type": "text", "text": part.text})
    return blocks or [{"type": "text", "text": ""}]


class MessageWriter:
    """One answer's id and model, as Anthropic's body or its events; ``plan`` splits
    the answer into thinking, text and tool_use blocks."""

    def __init__(self, model_id: str, plan: AnswerPlan):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model_id
        self.plan = plan

    def _message(self, content: list[dict], last: BatchStep | None, calls: bool,
                 usage: dict[str, int], stop_string: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None if last is None else stop_reason(last, calls),
            "stop_sequence": None if last is None else last.stop_string,
            "usage": usage,
        }

    async def body(self, first: BatchStep, stream: TokenStream) -> dict[str, Any]:
        parts, splitter, step = await whole_answer(first, stream, self.plan)
        return self._message(_blocks(parts), step, bool(splitter.calls), _usage(step))

    async def events(self, first: BatchStep, stream: TokenStream) -> AsyncIterator[str]:
        start_usage = dict(_usage(first), output_tokens=0)
        yield _event("message_start", {"type": "message_start",
                                       "message": self._message([], None, False, start_usage)})
        yield _event("ping", {"type": "ping"})
        splitter = self.plan.splitter()
        index, open_kind = -1, None

        def start(kind: str, block: dict) -> list[str]:
            nonlocal index, open_kind
            events = []
            if open_kind is not None:
                events.append(_event("content_block_stop",
                                     {"type": "content_block_stop", "index": index}))
            index, open_kind = index + 1, kind
            events.append(_event("content_block_start", {
                "type": "content_block_start", "index": index, "content_block": block}))
            return events

        try:
            async for step, parts in split_steps(first, stream, splitter):
                for part in parts:
                    if part.kind == "tool_call":
                        use = _tool_use(part.call)
                        for event in start("tool_use", {**use, "input": {}}):
                            yield event
                        yield _event("content_block_delta", {
                            "type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta",
                                      "partial_json": json.dumps(use["input"])}})
                        continue
                    kind = "thinking" if part.kind == "reasoning" else "text"
                    if open_kind != kind:
                        block = {"type": "thinking", "thinking": "", "signature": ""} \
                            if kind == "thinking" else {"type": "text", "text": ""}
                        for event in start(kind, block):
                            yield event
                    delta = {"type": "thinking_delta", "thinking": part.text} \
                        if kind == "thinking" else {"type": "text_delta", "text": part.text}
                    yield _event("content_block_delta", {
                        "type": "content_block_delta", "index": index, "delta": delta})
        except Exception as error:  # headers are sent: the failure goes as an error event
            yield _event("error", error_body(*logged_stream_failure(error),
                                             path=ANTHROPIC_PATH))
            return
        if open_kind is None:  # an empty answer still has its text block
            for event in start("text", {"type": "text", "text": ""}):
                yield event
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        yield _event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(step, bool(splitter.calls)),
                      "stop_sequence": step.stop_string},
            "usage": {"output_tokens": step.generation_tokens}})
        yield _event("message_stop", {"type": "message_stop"})
