"""Tools and thinking in a chat request: what the chat template is given (``tools``, the
template's own options) or, where the template renders no tools, the conversation with
the tools described and earlier calls as text (``generic_tools``); how the answer is
split (``answer_parts``); and the grammar (``tool_grammars``) that makes the answer a
call whose arguments validate against the function's parameters, for ``tool_choice``
"required" or a named function, and for "auto" on the generic format once a call
begins."""

from __future__ import annotations

from typing import Any

from mlxvlm.sampling.constrained import ConstraintError, GrammarConstraint, lark_constraint
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.text.answer_parts import (GENERIC_TOOLS, AnswerSplitter, ThinkFormat, ToolFormat,
                                        marker_ids, think_format, tool_format)
from mlxvlm.server.errors import APIError
from mlxvlm.server.generic_tools import as_plain_turns, describe_tools, with_description
from mlxvlm.server.schemas import ChatCompletionRequest, NamedToolChoice
from mlxvlm.server.template_traits import template_traits
from mlxvlm.server.tool_grammars import calls_grammar, text_or_calls_grammar
from mlxvlm.text.tokenization import chat_template_text, tokenizer_of


class AnswerPlan:
    """One request's tools and thinking: set up from the request and the processor;
    ``conversation`` gives the messages the template renders; once the prompt is
    rendered, ``splitter()`` for its answer."""

    def __init__(self, chat: ChatCompletionRequest, processor: Any):
        template = chat_template_text(processor)
        self.processor = processor
        self.tool_choice = chat.tool_choice or "auto"
        self.parallel = chat.parallel_tool_calls is not False
        traits = template_traits(processor, template)
        native = tool_format(template) if traits.renders_tools else None
        # Without a format of the template's own, calls and results go through it as
        # text in the generic format, and the tools are described in the prompt.
        self.generic = native is None
        self.takes_system = traits.takes_system
        wants_tools = bool(chat.tools) and self.tool_choice != "none"
        self.format: ToolFormat | None = (native or GENERIC_TOOLS) if wants_tools else None
        self.tools = chat.tools if wants_tools else []
        self.prompt_text = ""  # the rendered prompt, once prepared
        self.think: ThinkFormat | None = think_format(template)
        self.thinking = self.think is not None
        self.template_options: dict[str, Any] = dict(chat.chat_template_kwargs or {})
        self.description: str | None = None
        if self.tools and self.generic:
            choice = self.tool_choice.function.name if isinstance(
                self.tool_choice, NamedToolChoice) else self.tool_choice
            self.description = describe_tools(self.tools, choice, self.parallel)
        elif self.tools:
            self.template_options["tools"] = [tool.model_dump(exclude_none=True)
                                              for tool in self.tools]

    @property
    def forces_calls(self) -> bool:
        """"required" or a named function: the answer is calls only."""
        return bool(self.tools) and self.tool_choice != "auto"

    def conversation(self, messages: list[dict]) -> list[dict]:
        """The messages (``chat.to_messages``' shape) as the template is to render them."""
        if not self.generic:
            return messages
        messages = as_plain_turns(messages)
        if self.description is not None:
            messages = with_description(messages, self.description, self.takes_system)
        return messages

    def splitter(self) -> AnswerSplitter:
        reasoning_first = self.thinking and self.think.opened_by(self.prompt_text)
        parameters = {tool.function.name: tool.function.parameters or {}
                      for tool in self.tools}
        return AnswerSplitter(self.format, self.think, reasoning_first, parameters)

    def kept_token_ids(self) -> frozenset[int]:
        """The special tokens the answer's text keeps: the thinking and tool-call markers,
        where they are special tokens (Gemma 4's), so that the splitter sees them."""
        return marker_ids(tokenizer_of(self.processor), self.think,
                          self.format)

    def constraint(self) -> GrammarConstraint | None:
        """For "required" or a named function: an answer that is one call (or several,
        for "required" with parallel calls) in the format. For "auto" on the generic
        format: text, or calls that validate once begun. None: no grammar."""
        if not self.tools:
            return None
        tokenizer = tokenizer_of(self.processor)
        if self.tool_choice == "auto" and self.format is not GENERIC_TOOLS:
            return None  # a template's own format is read from the answer as it is
        try:  # a format may refuse a schema it cannot enforce (GLM's string patterns)
            if self.tool_choice == "auto":
                lark = text_or_calls_grammar(self.format, self.tools, tokenizer,
                                             self.parallel)
            else:
                if isinstance(self.tool_choice, NamedToolChoice):
                    chosen = [t for t in self.tools
                              if t.function.name == self.tool_choice.function.name]
                else:
                    chosen = self.tools
                several = self.tool_choice == "required" and self.parallel
                lark = calls_grammar(self.format, chosen, tokenizer, several)
            return lark_constraint(tokenizer, eos_token_ids(self.processor), lark,
                                   "the tools' parameters")
        except ConstraintError as error:
            raise APIError(400, str(error), param="tools") from None
