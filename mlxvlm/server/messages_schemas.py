"""The request body of Anthropic's ``POST /v1/messages``, validated strictly (as the chat
completions body is: ``schemas``), with the fields this server implements."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from mlxvlm.option_ranges import SAMPLING
from mlxvlm.server.schemas import MAX_STOP_STRINGS, StrictModel


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


ContentBlock = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


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
