"""The request body of OpenAI's ``POST /v1/responses``, validated strictly (as the chat
completions body is: ``schemas``), with the fields this server implements."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, ValidationInfo, field_validator

from mlxvlm.sampling.ranges import SAMPLING
from mlxvlm.server.schemas import FunctionDefinition, StrictModel, check_tool_choice


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    """An earlier answer's text, sent back as part of the conversation."""

    type: Literal["output_text"]
    text: str


class InputImage(StrictModel):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class InputFile(StrictModel):
    """A PDF as a data URL (or bare base64), as OpenAI's Responses API sends file_data."""

    type: Literal["input_file"]
    file_data: str = Field(min_length=1)
    filename: str | None = None


InputPart = Annotated[Union[InputText, OutputText, InputImage, InputFile],
                      Field(discriminator="type")]


class InputMessage(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]


class FunctionCallInput(StrictModel):
    """An earlier answer's call, sent back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = Union[InputMessage, FunctionCallInput, FunctionCallOutput]


class FunctionTool(FunctionDefinition):
    """Responses' function tool: chat completions' definition, not nested."""

    type: Literal["function"]


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class Reasoning(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None
    # The most thinking tokens (OpenRouter's name), then the thoughts are closed.
    max_tokens: int | None = Field(default=None, ge=1)


class TextFormat(StrictModel):
    """Responses' format: a json_schema one carries its name, schema and strict flag
    itself (chat completions nests them under ``json_schema``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(StrictModel):
    format: TextFormat | None = None


def _ranged(name: str):
    return Field(default=None, **SAMPLING[name].pydantic())


class ResponsesRequest(StrictModel):
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = _ranged("max_tokens")
    temperature: float | None = _ranged("temperature")
    top_p: float | None = _ranged("top_p")
    stream: bool = False
    # Whether the answer may be continued with previous_response_id (OpenAI's default).
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=200)
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None

    @field_validator("tool_choice")
    @classmethod
    def _chosen_tool_exists(cls, value, info: ValidationInfo):
        check_tool_choice(value.name if isinstance(value, NamedFunctionChoice) else None,
                          value == "required" and "required",
                          {tool.name for tool in info.data.get("tools") or []})
        return value
