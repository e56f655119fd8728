"""OpenAI's Responses API over the chat machinery: a ``ResponsesRequest`` (with the
conversation of the response it continues) as the ``ChatCompletionRequest`` it means,
generated steps as a response object or its stream of events, and the bounded store of
answered conversations that ``previous_response_id`` continues."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator

from mlxvlm.batching import BatchStep
from mlxvlm.server.answering import steps, stream_failure
from mlxvlm.server.errors import APIError, error_body
from mlxvlm.server.responses_schemas import ResponsesRequest
from mlxvlm.server.schemas import ChatCompletionRequest
from mlxvlm.server.service import TokenStream

logger = logging.getLogger("mlxvlm.server")

Conversation = list[dict[str, Any]]


class ResponseStore:
    """Answered conversations by response id, at most ``max_items`` (least recently used
    dropped first), each visible only under the API key (namespace) that made it."""

    def __init__(self, max_items: int):
        self.max_items = max_items
        self._items: OrderedDict[tuple[str | None, str], Conversation] = OrderedDict()

    def get(self, namespace: str | None, response_id: str) -> Conversation | None:
        key = (namespace, response_id)
        conversation = self._items.get(key)
        if conversation is not None:
            self._items.move_to_end(key)
        return conversation

    def put(self, namespace: str | None, response_id: str, conversation: Conversation) -> None:
        if self.max_items == 0:
            return
        self._items[(namespace, response_id)] = conversation
        self._items.move_to_end((namespace, response_id))
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def warn_unknown_fields(request: ResponsesRequest) -> None:
    unknown = sorted(request.model_extra or {})
    if unknown:
        logger.warning("ignoring request fields this server does not support: %s",
                       ", ".join(unknown))


def _part(part: Any) -> dict[str, Any]:
    if part.type == "input_image":
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    return {"type": "text", "text": part.text}


def input_messages(request: ResponsesRequest) -> Conversation:
    """The request's own input as messages (without the continued conversation)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages = []
    for item in request.input:
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
    return ChatCompletionRequest.model_validate({
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stream": request.stream,
        "response_format": response_format(request),
    })


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
    into the store (when the request lets it)."""

    def __init__(self, model_id: str, request: ResponsesRequest, conversation: Conversation,
                 store: ResponseStore, namespace: str | None):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model_id
        self.request = request
        self.conversation = conversation  # what was asked, without the instructions
        self.store = store
        self.namespace = namespace
        self._sequence = 0

    def _format(self) -> dict[str, Any]:
        fmt = self.request.text.format if self.request.text else None
        return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True,
                                                                   exclude_none=True)

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [
            {"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}

    def response(self, text: str | None, last: BatchStep | None) -> dict[str, Any]:
        """The response object: in progress (``last`` None) or answered."""
        request = self.request
        if last is None:
            status, output, incomplete = "in_progress", [], None
        elif last.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            output = [self._message(text or "", "incomplete")]
        else:
            status, incomplete = "completed", None
            output = [self._message(text or "", "completed")]
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
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": request.previous_response_id,
            "store": request.store,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "text": {"format": self._format()},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "metadata": request.metadata or {},
            "user": request.user,
            "usage": None if last is None else _usage(last),
        }

    def _remember(self, text: str) -> None:
        if self.request.store:
            self.store.put(self.namespace, self.id,
                           self.conversation + [{"role": "assistant", "content": text}])

    async def body(self, first: BatchStep, stream: TokenStream) -> dict[str, Any]:
        texts = []
        async for step in steps(first, stream):
            texts.append(step.text)
        text = "".join(texts)
        self._remember(text)
        return self.response(text, step)

    def _event(self, kind: str, **data: Any) -> str:
        self._sequence += 1
        payload = {"type": kind, "sequence_number": self._sequence, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events(self, first: BatchStep, stream: TokenStream) -> AsyncIterator[str]:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        yield self._event("response.created", response=self.response(None, None))
        yield self._event("response.in_progress", response=self.response(None, None))
        yield self._event("response.output_item.added", output_index=0,
                          item=self._message("", "in_progress"))
        yield self._event("response.content_part.added", **where,
                          part={"type": "output_text", "text": "", "annotations": []})
        texts = []
        try:
            async for step in steps(first, stream):
                if step.text:
                    texts.append(step.text)
                    yield self._event("response.output_text.delta", **where,
                                      delta=step.text, logprobs=[])
        except Exception as error:  # headers are sent: the failure goes as an error event
            logger.exception("generation failed while streaming")
            status, message = stream_failure(error)
            yield self._event("error", **error_body(status, message)["error"])
            return
        text = "".join(texts)
        self._remember(text)
        final = self.response(text, step)
        yield self._event("response.output_text.done", **where, text=text, logprobs=[])
        yield self._event("response.content_part.done", **where,
                          part={"type": "output_text", "text": text, "annotations": []})
        yield self._event("response.output_item.done", output_index=0,
                          item=final["output"][0])
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self._event(kind, response=final)
