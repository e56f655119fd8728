"""Tools and thinking in a chat request: what the chat template is given (``tools``, the
template's own options), how the answer is split (``answer_parts``), and for
``tool_choice`` "required" or a named function the grammar that makes the answer a call
whose arguments validate against the function's parameters."""

from __future__ import annotations

import json
from typing import Any

from mlxvlm.constrained import ConstraintError, GrammarConstraint, lark_constraint
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.server.answer_parts import (GEMMA4_TOOLS, AnswerSplitter, ThinkFormat, ToolFormat,
                                        marker_ids, think_format, tool_format)
from mlxvlm.server.errors import APIError
from mlxvlm.server.schemas import ChatCompletionRequest, NamedToolChoice


def chat_template(processor: Any) -> str:
    template = getattr(processor, "chat_template", None) or getattr(
        getattr(processor, "tokenizer", None), "chat_template", None)
    return template if isinstance(template, str) else json.dumps(template or "")


class AnswerPlan:
    """One request's tools and thinking: set up from the request and the processor,
    then, once the prompt is rendered, ``splitter()`` for its answer."""

    def __init__(self, chat: ChatCompletionRequest, processor: Any):
        template = chat_template(processor)
        self.processor = processor
        self.tool_choice = chat.tool_choice or "auto"
        wants_tools = bool(chat.tools) and self.tool_choice != "none"
        self.format: ToolFormat | None = tool_format(template) if wants_tools else None
        if wants_tools and self.format is None:
            raise APIError(400, "this model's chat template has no tool calling; send the "
                           "request without tools", param="tools")
        self.tools = chat.tools if wants_tools else []
        self.prompt_text = ""  # the rendered prompt, once prepared
        self.think: ThinkFormat | None = think_format(template)
        self.thinking = self.think is not None
        self.template_options: dict[str, Any] = dict(chat.chat_template_kwargs or {})
        if self.tools:
            self.template_options["tools"] = [tool.model_dump(exclude_none=True)
                                              for tool in self.tools]

    def splitter(self) -> AnswerSplitter:
        reasoning_first = self.thinking and self.think.opened_by(self.prompt_text)
        return AnswerSplitter(self.format, self.think, reasoning_first)

    def kept_token_ids(self) -> frozenset[int]:
        """The special tokens the answer's text keeps: the thinking and tool-call markers,
        where they are special tokens (Gemma 4's), so that the splitter sees them."""
        return marker_ids(getattr(self.processor, "tokenizer", self.processor), self.think,
                          self.format)

    def constraint(self) -> GrammarConstraint | None:
        """For "required" or a named function: an answer that is one call (or several,
        for "required") in the family's format."""
        if not self.tools or self.tool_choice == "auto":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            chosen = [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        else:
            chosen = self.tools
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        several = self.tool_choice == "required"
        if self.format is GEMMA4_TOOLS:
            lark = _gemma4_call_grammar(chosen, tokenizer, several)
        else:
            schema = {"anyOf": [_call_schema(tool) for tool in chosen]} if len(chosen) > 1 \
                else _call_schema(chosen[0])
            lark = _call_grammar(self.format, schema, tokenizer, several=several)
        try:
            return lark_constraint(tokenizer, eos_token_ids(self.processor), lark,
                                   "the tools' parameters")
        except ConstraintError as error:
            raise APIError(400, str(error), param="tools") from None


def _call_schema(tool: Any) -> dict:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _literal(text: str, tokenizer: Any) -> str:
    """``text`` in the grammar: a special token by its id (its bytes never match text),
    anything else as a string."""
    special = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
               if getattr(t, "special", False)}
    if text in special:
        return f"<[{special[text]}]>"
    return json.dumps(text)


def _call_grammar(fmt: ToolFormat, schema: dict, tokenizer: Any, several: bool) -> str:
    opening = _literal(fmt.open, tokenizer)
    if fmt.close is None:  # Mistral: [TOOL_CALLS] then a JSON list of calls
        listed = {"type": "array", "items": schema, "minItems": 1}
        if not several:
            listed["maxItems"] = 1
        return f"start: {opening} calls\ncalls: %json {json.dumps(listed)}\n"
    more = ' ("\\n" block)*' if several else ""
    return (f"start: block{more}\n"
            f'block: {opening} "\\n" call "\\n" {_literal(fmt.close, tokenizer)}\n'
            f"call: %json {json.dumps(schema)}\n")


def _gemma4_call_grammar(chosen: list, tokenizer: Any, several: bool) -> str:
    """Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>`` with the arguments as JSON
    under the function's parameters (Gemma's own quoting has no schema grammar; the
    parser reads either)."""
    fmt = GEMMA4_TOOLS
    rules = [f"start: block{'+' if several else ''}",
             f"block: {_literal(fmt.open, tokenizer)} call {_literal(fmt.close, tokenizer)}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        parameters = tool.function.parameters or {"type": "object", "properties": {}}
        rules.append(f"call_{i}: {json.dumps('call:' + tool.function.name)} arguments_{i}")
        rules.append(f"arguments_{i}: %json {json.dumps(parameters)}")
    return "\n".join(rules) + "\n"
