"""The request body of ``POST /v1/chat/completions``, validated strictly.

Types are strict (a string is not a number, ``1.0`` is not an integer) and ranges are
OpenAI's. Fields this server does not know are kept in ``model_extra`` so that the
route can log them instead of silently dropping them.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mlxvlm.batching import MAX_TOP_LOGPROBS

# Up to this many stop strings (OpenAI allows 4; some clients send a few more).
MAX_STOP_STRINGS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ImageURL(_Strict):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: dict


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: dict


ContentPart = Annotated[
    Union[TextPart, ImagePart, InputAudioPart, VideoPart], Field(discriminator="type")
]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    n: int | None = Field(default=None, ge=1)
    user: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.logit_bias:
            for key in self.logit_bias:
                if not key.isdigit():
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return self

    @property
    def token_budget(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens
