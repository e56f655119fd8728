"""Chat completions: a validated request -> messages and sampling options; generated
steps -> OpenAI's response body or its stream of chunks."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from pydantic import ValidationError

from mlxvlm.batching import BatchStep
from mlxvlm.sampling import SamplingOptions
from mlxvlm.sampling.defaults import FIELDS as SAMPLING_FIELDS
from mlxvlm.sampling.defaults import (
    NO_CHECKPOINT_DEFAULTS,
    OPENAI_DEFAULTS,
    CheckpointDefaults,
    describe_checkpoint,
    resolve,
)
from mlxvlm.server.errors import APIError, validation_error
from mlxvlm.server.schemas import ChatCompletionRequest

logger = logging.getLogger("mlxvlm.server")


def describe_sampling_defaults(checkpoint: CheckpointDefaults) -> str:
    """For the start-up log: what a request that sets no sampling field gets."""
    return describe_checkpoint(checkpoint, OPENAI_DEFAULTS, "OpenAI's default")


def warn_unknown_fields(request: Any) -> None:
    """Fields this server does not implement are ignored, and said so in the log (of any
    endpoint's request: its own fields and its messages')."""
    unknown = sorted(request.model_extra or {})
    for index, message in enumerate(getattr(request, "messages", None) or []):
        unknown += [f"messages[{index}].{name}" for name in sorted(message.model_extra or {})]
    if unknown:
        logger.warning("ignoring request fields this server does not support: %s",
                       ", ".join(unknown))


def as_chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat completions request another API's request (Messages, Responses) means.
    What chat completions' rules refuse in it is the client's mistake, a 400, as it is
    on chat completions (each API validates its own fields first, with its own names)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


def to_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation in the shape ``mlxvlm.prompt`` takes."""
    messages = []
    for message in request.messages:
        # Chat templates know "system"; OpenAI's newer name for it is "developer".
        role = "system" if message.role == "developer" else message.role
        if message.content is None or isinstance(message.content, str):
            content: Any = message.content or ""
        else:
            content = [part.model_dump(exclude_none=True) for part in message.content]
        entry: dict[str, Any] = {"role": role, "content": content}
        if message.tool_calls:
            # Chat templates take a call's arguments as a mapping, not OpenAI's JSON text.
            entry["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": _arguments(call.function.arguments)}}
                for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None and role == "tool":
            entry["name"] = message.name
        messages.append(entry)
    return messages


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise APIError(400, "a tool call's arguments must be JSON text",
                       param="messages") from None


def sampling_options(
    request: ChatCompletionRequest,
    default_max_tokens: int,
    vocab_size: int,
    checkpoint: CheckpointDefaults = NO_CHECKPOINT_DEFAULTS,
) -> SamplingOptions:
    """The request's options; those it leaves out come from the checkpoint's
    generation_config.json (``checkpoint``), else OpenAI's defaults."""
    if request.n is not None and request.n > 1:
        raise APIError(400, "n > 1 is not supported; send n separate requests", param="n")
    logit_bias = None
    if request.logit_bias:
        logit_bias = {int(token): bias for token, bias in request.logit_bias.items()}
        outside = [t for t in logit_bias if t >= vocab_size]
        if outside:
            raise APIError(400, f"logit_bias names token {outside[0]}, but the vocabulary "
                           f"has {vocab_size} tokens", param="logit_bias")
    given = {name: getattr(request, name) for name in SAMPLING_FIELDS}
    resolved = resolve(given, checkpoint, OPENAI_DEFAULTS, "OpenAI's default")
    logger.debug("sampling: %s", resolved.describe())
    chosen = resolved.values
    return SamplingOptions(
        max_tokens=request.token_budget or default_max_tokens,
        **chosen,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=logit_bias,
        seed=request.seed,
        stop=request.stop,
        top_logprobs=(request.top_logprobs or 0) if request.logprobs else None,
    )


def usage(step: BatchStep) -> dict[str, Any]:
    return {
        "prompt_tokens": step.prompt_tokens,
        "completion_tokens": step.generation_tokens,
        "total_tokens": step.prompt_tokens + step.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": step.cached_tokens},
    }


class CompletionWriter:
    """One completion's id, timestamps and model name, and its bodies and chunks."""

    def __init__(self, model_id: str):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_id

    def body(self, message: dict[str, Any], finish_reason: str | None,
             last: BatchStep, logprobs: list[dict] | None) -> dict[str, Any]:
        """``message``: the answer's fields beside its role (content, and where there
        are any, reasoning_content and tool_calls)."""
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", **message, "refusal": None},
                    "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage(last),
        }

    def chunk(
        self,
        delta: dict[str, Any],
        *,
        finish_reason: str | None = None,
        logprobs: list[dict] | None = None,
        include_usage: bool = False,
    ) -> str:
        data: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                    "finish_reason": finish_reason,
                }
            ],
        }
        if include_usage:
            data["usage"] = None  # every chunk but the usage chunk, as OpenAI sends them
        return sse(data)

    def usage_chunk(self, last: BatchStep) -> str:
        return sse({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(last),
        })


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
