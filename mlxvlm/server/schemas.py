"""The request body of ``POST /v1/chat/completions``, validated strictly.

Types are strict (a string is not a number, ``1.0`` is not an integer); the numeric
ranges are ``mlxvlm.sampling.ranges``' (OpenAI's where OpenAI has the field), shared with
the command lines, and exclude NaN and infinities (which Python's json writes). Fields this server does not know are kept in ``model_extra`` so that the
route can log them instead of silently dropping them.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mlxvlm.sampling.ranges import SAMPLING
from mlxvlm.text.doctags import OUTPUT_FORMATS

# Up to this many stop strings (OpenAI allows 4; some clients send a few more).
MAX_STOP_STRINGS = 16


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ImageURL(StrictModel):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FileData(StrictModel):
    # A PDF as a data URL (data:application/pdf;base64,...) or bare base64; OpenAI's
    # uploaded files (file_id) live on OpenAI's side, so this server refuses them.
    file_data: str | None = Field(default=None, min_length=1)
    file_id: str | None = None
    filename: str | None = None

    @field_validator("file_id")
    @classmethod
    def _no_uploads(cls, value):
        if value is not None:
            raise ValueError("file_id is not supported (this server keeps no uploaded "
                             "files); send the PDF's bytes as file_data")
        return value


class FilePart(StrictModel):
    """OpenAI's file part: a PDF whose pages become images of the message."""

    type: Literal["file"]
    file: FileData

    @field_validator("file")
    @classmethod
    def _has_data(cls, value):
        if value.file_data is None:
            raise ValueError("a file part needs file_data (data:application/pdf;base64,...)")
        return value


class InputAudioPart(StrictModel):
    type: Literal["input_audio"]
    input_audio: dict


class VideoPart(StrictModel):
    type: Literal["video_url"]
    video_url: dict


ContentPart = Annotated[
    Union[TextPart, ImagePart, InputAudioPart, VideoPart, FilePart], Field(discriminator="type")
]


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallItem(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(StrictModel):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # "schema" is a name pydantic's BaseModel keeps for itself.
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(StrictModel):
    include_usage: bool = False


class AudioOutput(StrictModel):
    """OpenAI's ``audio`` field: the voice and format of a spoken answer."""

    voice: str | None = None  # None: the checkpoint's default voice
    format: Literal["wav", "pcm16"] = "wav"


def _ranged(name: str):
    """A field limited to ``name``'s range, the one the command lines check too."""
    return Field(default=None, **SAMPLING[name].pydantic())


# Token ids as logit_bias keys: ASCII digits only (str.isdigit also takes "²" and other
# digits int() refuses), and few enough of them for int() (Python refuses to parse more
# than 4300 digits); the vocabulary bounds them further.
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def check_tool_choice(named: str | None, requiring: str | None, names: set[str]) -> None:
    """A tool choice that names a function not among the tools (``named``), or requires
    a call (``requiring``: its value, e.g. "required") where there are no tools, is the
    client's mistake: a ValueError, which validation answers with a 400."""
    if named is not None and named not in names:
        raise ValueError(f"tool_choice names {named!r}, which is not one of the tools")
    if requiring and not names:
        raise ValueError(f"tool_choice {requiring!r} needs tools")


def _set_only_with(flag: str, message: str):
    """A field validator: the field may be set only when the earlier field ``flag`` is
    true."""

    def check(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get(flag):
            raise ValueError(message)
        return value

    return classmethod(check)


class ChatCompletionRequest(StrictModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = _ranged("max_tokens")
    max_completion_tokens: int | None = _ranged("max_tokens")
    temperature: float | None = _ranged("temperature")
    top_p: float | None = _ranged("top_p")
    top_k: int | None = _ranged("top_k")
    min_p: float | None = _ranged("min_p")
    repetition_penalty: float | None = _ranged("repetition_penalty")
    presence_penalty: float | None = _ranged("presence_penalty")
    frequency_penalty: float | None = _ranged("frequency_penalty")
    logit_bias: dict[str, Annotated[float, Field(**SAMPLING["logit_bias_value"].pydantic())]] | None = None
    seed: int | None = _ranged("seed")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = _ranged("top_logprobs")
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # What the chat template itself takes, e.g. {"enable_thinking": false} (vLLM's name).
    chat_template_kwargs: dict | None = None
    # At most this many thinking tokens, then the end-of-thinking tag is forced (the
    # name of Qwen's API; Anthropic's thinking.budget_tokens and Responses'
    # reasoning.max_tokens come here too).
    thinking_budget: int | None = Field(default=None, ge=1)
    # OpenAI's limit; only 1 is served (see chat.sampling_options).
    n: int | None = Field(default=None, ge=1, le=128)
    user: str | None = None
    # mlxvlm's own: a DocTags model's answer as its raw DocTags, or converted whole by
    # docling-core (text/doctags.py); "doctags" alone streams.
    output_format: Literal[OUTPUT_FORMATS] | None = None
    # OpenAI's audio output: ["text", "audio"] speaks the answer in ``audio``'s voice
    # and format (mlxvlm/server/speech.py); talker_temperature is mlxvlm's own (0: the
    # talker's argmax; left out: the checkpoint's talker sampling).
    modalities: Annotated[list[Literal["text", "audio"]], Field(min_length=1)] | None = None
    audio: AudioOutput | None = None
    talker_temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # the most codec frames spoken (12.5 a second for Qwen3-Omni); left out: 4096
    talker_max_frames: int | None = Field(default=None, ge=1)

    # Field validators rather than one model validator, so that the error's location
    # (and with it the error body's "param") names the field.
    _only_when_streaming = field_validator("stream_options")(
        _set_only_with("stream", "stream_options is only allowed when stream is true"))
    _needs_logprobs = field_validator("top_logprobs")(
        _set_only_with("logprobs", "top_logprobs needs logprobs set to true"))

    @field_validator("output_format")
    @classmethod
    def _converted_whole(cls, value, info: ValidationInfo):
        if value not in (None, "doctags") and info.data.get("stream"):
            raise ValueError(f"output_format {value} converts the whole answer: send stream "
                             "false (or output_format doctags to stream the raw DocTags)")
        return value

    @field_validator("audio")
    @classmethod
    def _audio_needs_the_modality(cls, value, info: ValidationInfo):
        if value is not None and "audio" not in (info.data.get("modalities") or []):
            raise ValueError('audio needs modalities ["text", "audio"]')
        return value

    @field_validator("talker_temperature", "talker_max_frames")
    @classmethod
    def _talker_needs_the_modality(cls, value, info: ValidationInfo):
        if value is not None and "audio" not in (info.data.get("modalities") or []):
            raise ValueError(f'{info.field_name} needs modalities ["text", "audio"]')
        return value

    @property
    def speaks(self) -> bool:
        return "audio" in (self.modalities or [])

    @field_validator("response_format")
    @classmethod
    def _schema_given(cls, value):
        if value is not None and value.type == "json_schema" and (
                value.json_schema is None or value.json_schema.json_schema is None):
            raise ValueError("a json_schema response format needs json_schema.schema")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _named_tool_exists(cls, value, info: ValidationInfo):
        check_tool_choice(value.function.name if isinstance(value, NamedToolChoice) else None,
                          value == "required" and "required",
                          {tool.function.name for tool in info.data.get("tools") or []})
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        for key in value or {}:
            if not _TOKEN_ID.fullmatch(key):
                shown = key if len(key) <= 20 else key[:20] + "..."
                raise ValueError(f"logit_bias keys must be token ids (0-9 digits), got {shown!r}")
        return value

    @property
    def token_budget(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens
