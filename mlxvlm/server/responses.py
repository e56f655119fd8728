"""OpenAI's Responses API over the chat machinery: a ``ResponsesRequest`` (with the
conversation of the response it continues) as the ``ChatCompletionRequest`` it means,
generated steps as a response object or its stream of events, and the bounded store of
answered conversations that ``previous_response_id`` continues (``response_store``)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from mlxvlm.batching import BatchStep
from mlxvlm.text.answer_parts import Part, ToolCall
from mlxvlm.server.answering import logged_stream_failure, split_steps, whole_answer
from mlxvlm.server.chat_completions import as_chat_request
from mlxvlm.server.errors import APIError, error_body
from mlxvlm.server.response_store import ResponseStore
from mlxvlm.server.responses_schemas import ResponsesRequest
from mlxvlm.server.schemas import ChatCompletionRequest
from mlxvlm.server.service import TokenStream
from mlxvlm.server.tools import AnswerPlan


Conversation = list[dict[str, Any]]


def _part(part: Any) -> dict[str, Any]:
    if part.type == "input_image":
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    if part.type == "input_file":
        return {"type": "file", "file": {"file_data": part.file_data,
                                         "filename": part.filename}}
    return {"type": "text", "text": part.text}


def input_messages(request: ResponsesRequest) -> Conversation:
    """The request's own input as messages (without the continued conversation)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: Conversation = []
    for item in request.input:
        if item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
            continue
        role = "system" if item.role == "developer" else item.role
        content = item.content if isinstance(item.content, str) else [
            _part(part) for part in item.content]
        messages.append({"role": role, "content": content})
    return messages


def response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat completions' ``response_format``."""
    fmt = request.text.format if request.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise APIError(400, "a json_schema text format needs its schema",
                       param="text.format.schema")
    return {"type": "json_schema", "json_schema": {
        "name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}}


def to_chat_request(request: ResponsesRequest, earlier: Conversation) -> ChatCompletionRequest:
    """The whole conversation (``earlier``: the continued response's) and the request's
    options as a chat completions request. ``instructions`` apply to this request only,
    as OpenAI's do: they are not carried into the stored conversation."""
    messages = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages += earlier + input_messages(request)
    return as_chat_request({
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stream": request.stream,
        "response_format": response_format(request),
        "tools": [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in request.tools] if request.tools else None,
        "tool_choice": _chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "chat_template_kwargs": _template_kwargs(request),
        "thinking_budget": request.reasoning.max_tokens if request.reasoning else None,
    })


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _wire_tool_choice(choice: Any) -> Any:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _template_kwargs(request: ResponsesRequest) -> dict | None:
    """``reasoning.effort`` "none" turns a template's thinking off; any other keeps it."""
    if request.reasoning is None or request.reasoning.effort is None:
        return None
    return {"enable_thinking": request.reasoning.effort != "none"}


def _usage(last: BatchStep) -> dict[str, Any]:
    return {
        "input_tokens": last.prompt_tokens,
        "input_tokens_details": {"cached_tokens": last.cached_tokens},
        "output_tokens": last.generation_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": last.prompt_tokens + last.generation_tokens,
    }


class ResponseWriter:
    """One response's ids, its object and events; once answered, its conversation goes
    into the store (when the request lets it). ``plan`` splits the answer into a
    reasoning item, a message and function calls."""

    def __init__(self, model_id: str, request: ResponsesRequest, conversation: Conversation,
                 store: ResponseStore, namespace: str | None, plan: AnswerPlan):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model_id
        self.request = request
        self.conversation = conversation  # what was asked, without the instructions
        self.store = store
        self.namespace = namespace
        self.plan = plan
        self.stored: bool | None = None  # once answered: whether the store kept it
        self._sequence = 0

    def _format(self) -> dict[str, Any]:
        fmt = self.request.text.format if self.request.text else None
        return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True,
                                                                   exclude_none=True)

    def response(self, output: list[dict] | None, last: BatchStep | None) -> dict[str, Any]:
        """The response object: in progress (``last`` None) or answered."""
        request = self.request
        if last is None:
            status, incomplete = "in_progress", None
        elif last.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            status, incomplete = "completed", None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": output or [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            # False where the store could not keep it (too large for its bounds).
            "store": request.store if self.stored is None else self.stored,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "text": {"format": self._format()},
            "tool_choice": _wire_tool_choice(request.tool_choice),
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "truncation": "disabled",
            "metadata": request.metadata or {},
            "user": request.user,
            "usage": None if last is None else _usage(last),
        }

    def _remember(self, items: list[dict]) -> None:
        if not self.request.store:
            self.stored = False
            return
        text = "".join(part["text"] for item in items if item["type"] == "message"
                       for part in item["content"])
        answer: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [item for item in items if item["type"] == "function_call"]
        if calls:
            answer["tool_calls"] = [
                {"id": c["call_id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls]
        self.stored = self.store.put(self.namespace, self.id, self.conversation + [answer])

    async def body(self, first: BatchStep, stream: TokenStream) -> dict[str, Any]:
        parts, _, step = await whole_answer(first, stream, self.plan)
        status = "incomplete" if step.finish_reason == "length" else "completed"
        items: list[dict] = []
        for part in parts:
            if items and part.kind != "tool_call" and items[-1]["kind"] == part.kind:
                items[-1]["text"] += part.text
            else:
                items.append({"kind": part.kind, "text": part.text, "call": part.call})
        output = [_item(entry["kind"], _new_id(entry["kind"]), entry["text"], entry["call"],
                        status) for entry in items] or [_item("content", _new_id("content"),
                                                             "", None, status)]
        self._remember(output)
        return self.response(output, step)

    def _event(self, kind: str, **data: Any) -> str:
        self._sequence += 1
        payload = {"type": kind, "sequence_number": self._sequence, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events(self, first: BatchStep, stream: TokenStream) -> AsyncIterator[str]:
        yield self._event("response.created", response=self.response(None, None))
        yield self._event("response.in_progress", response=self.response(None, None))
        items = _StreamedItems(self._event)
        splitter = self.plan.splitter()
        try:
            async for step, parts in split_steps(first, stream, splitter):
                for part in parts:
                    for event in items.add(part):
                        yield event
        except Exception as error:  # headers are sent: the failure goes as an error event
            status, message = logged_stream_failure(error)
            yield self._event("error", **error_body(status, message)["error"])
            return
        status = "incomplete" if step.finish_reason == "length" else "completed"
        for event in items.close(status):
            yield event
        self._remember(items.done)
        final = self.response(items.done, step)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self._event(kind, response=final)


def _new_id(kind: str) -> str:
    prefix = {"content": "msg", "reasoning": "rs", "tool_call": "fc"}[kind]
    return f"{prefix}_{uuid.uuid4().hex}"


def _item(kind: str, item_id: str, text: str, call: ToolCall | None,
          status: str) -> dict[str, Any]:
    """One output item, as the Responses API writes it."""
    if kind == "tool_call":
        return {"type": "function_call", "id": item_id, "call_id": call.id,
                "name": call.name, "arguments": call.arguments, "status": "completed"}
    if kind == "reasoning":
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
                "status": status}
    content = [] if status == "in_progress" else [
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


class _StreamedItems:
    """The output items of a streamed response as its parts arrive: each item is opened,
    filled and closed with the official events."""

    def __init__(self, event):
        self.event = event
        self.done: list[dict] = []
        self.kind: str | None = None  # the open item's kind
        self.id = ""
        self.text = ""

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": len(self.done), "content_index": 0}

    def _open(self, kind: str) -> list[str]:
        self.kind, self.id, self.text = kind, _new_id(kind), ""
        events = [self.event("response.output_item.added", output_index=len(self.done),
                             item=_item(kind, self.id, "", None, "in_progress"))]
        if kind == "content":
            events.append(self.event("response.content_part.added", **self._where(),
                                     part={"type": "output_text", "text": "",
                                           "annotations": []}))
        return events

    def _close(self, status: str) -> list[str]:
        if self.kind is None:
            return []
        where, text = self._where(), self.text
        if self.kind == "content":
            events = [
                self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where,
                           part={"type": "output_text", "text": text, "annotations": []})]
        else:
            events = [self.event("response.reasoning_text.done", **where, text=text)]
        item = _item(self.kind, self.id, text, None, status)
        events.append(self.event("response.output_item.done", output_index=len(self.done),
                                 item=item))
        self.done.append(item)
        self.kind = None
        return events

    def add(self, part: Part) -> list[str]:
        if part.kind == "tool_call":
            events = self._close("completed")
            item_id, index = _new_id("tool_call"), len(self.done)
            call = part.call
            item = _item("tool_call", item_id, "", call, "completed")
            events += [
                self.event("response.output_item.added", output_index=index,
                           item=dict(item, arguments="", status="in_progress")),
                self.event("response.function_call_arguments.delta", item_id=item_id,
                           output_index=index, delta=call.arguments),
                self.event("response.function_call_arguments.done", item_id=item_id,
                           output_index=index, name=call.name, arguments=call.arguments),
                self.event("response.output_item.done", output_index=index, item=item)]
            self.done.append(item)
            return events
        events = [] if self.kind == part.kind else self._close("completed") + self._open(part.kind)
        self.text += part.text
        name = "response.output_text.delta" if part.kind == "content" else \
            "response.reasoning_text.delta"
        extra = {"logprobs": []} if part.kind == "content" else {}
        events.append(self.event(name, **self._where(), delta=part.text, **extra))
        return events

    def close(self, status: str) -> list[str]:
        if self.kind is None and not self.done:  # an empty answer is an empty message
            return self._open("content") + self._close(status)
        return self._close(status)
