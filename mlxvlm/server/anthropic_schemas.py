"""The request body of Anthropic's ``POST /v1/messages``, validated strictly (as the chat
completions body is: ``schemas``), with the fields this server implements."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, ValidationInfo, field_validator

from mlxvlm.sampling.ranges import SAMPLING
from mlxvlm.server.schemas import MAX_STOP_STRINGS, StrictModel, check_tool_choice


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str


class Base64Source(StrictModel):
    type: Literal["base64"]
    media_type: str = Field(min_length=1, max_length=100)
    data: str = Field(min_length=1)


class URLSource(StrictModel):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(StrictModel):
    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource], Field(discriminator="type")]


class DocumentBlock(StrictModel):
    """A PDF (base64 data) whose pages become images of the message."""

    type: Literal["document"]
    source: Base64Source
    title: str | None = None


class ToolUseBlock(StrictModel):
    """An earlier answer's call."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[Union[TextBlock, ImageBlock],
                                  Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlock(StrictModel):
    """An earlier answer's thinking (chat templates drop it from earlier turns)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock,
                               ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


class AnthropicTool(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    input_schema: dict


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


def _ranged(name: str):
    return Field(default=None, **SAMPLING[name].pydantic())


class MessagesRequest(StrictModel):
    model: str
    # Required by Anthropic's API, as here.
    max_tokens: int = Field(**SAMPLING["max_tokens"].pydantic())
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: float | None = _ranged("temperature")
    top_p: float | None = _ranged("top_p")
    top_k: int | None = _ranged("top_k")
    metadata: dict | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("tool_choice")
    @classmethod
    def _chosen_tool_exists(cls, value, info: ValidationInfo):
        if value is not None:
            if value.type == "tool" and not value.name:
                raise ValueError("tool_choice of type 'tool' needs the tool's name")
            check_tool_choice(value.name if value.type == "tool" else None,
                              value.type == "any" and "any",
                              {tool.name for tool in info.data.get("tools") or []})
        return value
