"""A generated answer split into its parts: the model's reasoning (a thinking model's
``<think>`` ... ``</think>``, or Gemma 4's ``<|channel>thought`` ... ``<channel|>``), the
text for the user, and tool calls in the format the checkpoint's chat template teaches
(Hermes/Qwen's ``<tool_call>{json}</tool_call>``, Mistral's ``[TOOL_CALLS]``, Gemma 4's
``<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>``, GLM's
``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``).
``AnswerSplitter`` takes the text as it streams and holds back only what may still begin
a marker."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from mlx_lm.tool_parsers import gemma4 as gemma4_calls

from mlxvlm.text import glm_tool_calls

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkFormat:
    """How a family marks its thoughts: ``open`` ... ``close``; ``label`` names the
    channel right after ``open`` and is not part of the thoughts; ``special``: the
    markers are special tokens, which the answer's text keeps only when asked
    (``marker_ids``)."""

    name: str
    open: str
    close: str
    label: str = ""
    special: bool = False

    def opened_by(self, prompt_text: str) -> bool:
        """Whether a generation prompt ends inside an opened thinking block."""
        text = prompt_text.rstrip()
        return text.endswith(self.open) or bool(self.label) and text.endswith(
            (self.open + self.label).rstrip())


THINK = ThinkFormat("think", THINK_OPEN, THINK_CLOSE)
# Gemma 4: <|think|> in the system turn switches thinking on; the model then writes
# <|channel>thought\n, its thoughts, <channel|> and the answer.
GEMMA4_THINK = ThinkFormat("gemma4", "<|channel>", "<channel|>", label="thought\n",
                           special=True)


@dataclass(frozen=True)
class ToolFormat:
    """How a family writes tool calls: ``open`` starts one; ``close`` ends it (None: the
    calls run to the end of the answer, as Mistral's do); ``quote``: the family's own
    string delimiter inside a call; ``fields``: the tags inside a call (GLM's argument
    tags); ``special``: the markers (and quote) are special tokens, which the answer's
    text keeps only when asked (``marker_ids``)."""

    name: str
    open: str
    close: str | None
    quote: str = ""
    special: bool = False
    fields: tuple[str, ...] = ()

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.open, self.close, self.quote, *self.fields) if m)


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
# The format this server teaches a model whose chat template renders no tools
# (generic_tools): Hermes' markers around a {"name", "arguments"} object.
GENERIC_TOOLS = ToolFormat("generic", "<tool_call>", "</tool_call>")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", None)
# Gemma 4: <|tool_call>call:NAME{key:value,...}<tool_call|>, keys bare, strings between
# <|"|> quotes (no escaping), other values as JSON writes them.
GEMMA4_TOOLS = ToolFormat("gemma4", "<|tool_call>", "<tool_call|>", quote='<|"|>',
                          special=True)

# GLM-4.5V / 4.6V: Hermes' markers around NAME and <arg_key>/<arg_value> pairs
# (glm_tool_calls).
GLM_TOOLS = ToolFormat("glm", "<tool_call>", "</tool_call>", fields=glm_tool_calls.MARKERS)


def tool_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format the chat template renders (None: it renders no tools)."""
    template = chat_template or ""
    if GLM_TOOLS.open in template and glm_tool_calls.KEY_OPEN in template:
        return GLM_TOOLS
    if HERMES.open in template:
        return HERMES
    if MISTRAL.open in template:
        return MISTRAL
    if GEMMA4_TOOLS.open in template and GEMMA4_TOOLS.close in template:
        return GEMMA4_TOOLS
    return None


def think_format(chat_template: str | None) -> ThinkFormat | None:
    """The thinking format the chat template teaches (None: it does not think)."""
    template = chat_template or ""
    if "<|think|>" in template or GEMMA4_THINK.open in template:
        return GEMMA4_THINK
    if THINK_OPEN in template:
        return THINK
    return None


def as_think_format(thinking: ThinkFormat | bool | None) -> ThinkFormat | None:
    """A thinking format from a format or a flag (True: ``<think>``)."""
    return THINK if thinking is True else thinking or None


def thinks(chat_template: str | None) -> bool:
    return think_format(chat_template) is not None


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special added tokens by their text."""
    return {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if getattr(t, "special", False)}


def added_token_ids(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added tokens (special or not) by their text."""
    return {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}


def marker_ids(tokenizer: Any, *formats: ThinkFormat | ToolFormat | None) -> frozenset[int]:
    """The ids of the formats' special-token markers, for the answer's text to keep (the
    detokenizer drops special tokens otherwise); a format adds none when its markers are
    plain text or the tokenizer does not have them all as single tokens. A tool format
    of plain-text markers keeps those this tokenizer holds as special tokens (the
    generic format's ``<tool_call>`` on a tokenizer that made it special)."""
    ids: set[int] = set()
    for fmt in formats:
        if fmt is None:
            continue
        markers = fmt.markers if isinstance(fmt, ToolFormat) else (fmt.open, fmt.close)
        if not fmt.special:
            if isinstance(fmt, ToolFormat):
                special = special_token_ids(tokenizer)
                ids.update(special[m] for m in markers if m in special)
            continue
        encoded = [tokenizer.encode(m, add_special_tokens=False) for m in markers]
        if all(len(e) == 1 for e in encoded):
            ids.update(int(e[0]) for e in encoded)
    return frozenset(ids)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _calls_from_json(value: Any) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def parse_calls(fmt: ToolFormat, body: str,
                parameters: Mapping[str, Any] | None = None) -> list[ToolCall] | None:
    """The calls in one tool region's text (between the markers); None: not calls.
    ``parameters``: the functions' parameter schemas by name, for a format whose values
    are typed by them (GLM's)."""
    body = body.strip()
    if fmt is GLM_TOOLS:
        call = glm_tool_calls.parse_call(body, parameters)
        return None if call is None else [
            ToolCall(call[0], json.dumps(call[1], ensure_ascii=False))]
    if fmt is GEMMA4_TOOLS:
        return _gemma4_calls(body)
    if fmt is MISTRAL and "[ARGS]" in body:  # the newer form: name[ARGS]{...} per call
        calls = []
        for piece in body.split(fmt.open):
            name, _, arguments = piece.partition("[ARGS]")
            try:
                parsed = json.loads(arguments)
            except ValueError:
                return None
            calls.append(ToolCall(name.strip(), json.dumps(parsed, ensure_ascii=False)))
        return calls
    try:
        return _calls_from_json(json.loads(body))
    except ValueError:
        return None


def _gemma4_calls(body: str) -> list[ToolCall] | None:
    """Gemma 4's ``call:NAME{...}``: the arguments as JSON (what the tool-choice grammar
    writes), else in Gemma's own quoting (mlx-lm's parser turns it into JSON)."""
    if not body.startswith("call:"):
        return None
    name, brace, rest = body[len("call:"):].partition("{")
    if brace and name.replace("_", "").replace("-", "").isalnum():
        try:
            arguments = json.loads(brace + rest)
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            return [ToolCall(name, json.dumps(arguments, ensure_ascii=False))]
    try:
        parsed = gemma4_calls.parse_tool_call(body)
    except ValueError:
        return None
    return _calls_from_json(parsed)


@dataclass
class Part:
    kind: str  # "reasoning", "content" or "tool_call"
    text: str = ""
    call: ToolCall | None = None


class AnswerSplitter:
    """Feed the answer's text as it comes (``feed``), then ``finish``; each returns the
    parts now known. ``thinking``: the thinking format (True: ``<think>``; False or None:
    no thinking). ``reasoning_first``: the prompt already opened the thinking block (a
    template that ends its generation prompt with ``<think>``). ``parameters``: the
    functions' parameter schemas by name (``parse_calls``)."""

    def __init__(self, tools: ToolFormat | None, thinking: ThinkFormat | bool | None,
                 reasoning_first: bool = False,
                 parameters: Mapping[str, Any] | None = None):
        self.tools = tools
        self.parameters = parameters
        self.think = as_think_format(thinking)
        self.thinking = self.think is not None
        self.state = "reasoning" if reasoning_first else "content"
        self.label_pending = reasoning_first  # the label may still begin the thoughts
        self.buffer = ""
        self.calls: list[ToolCall] = []
        self.region_ended = False
        self.emitted = False  # any part yet

    def _opening_markers(self) -> list[tuple[str, str]]:
        markers = []
        if self.think is not None:
            markers.append((self.think.open, "reasoning"))
        if self.tools is not None:
            markers.append((self.tools.open, "tool"))
        return markers

    def _emit(self, kind: str, text: str, parts: list[Part]) -> None:
        if self.region_ended and kind == "content":
            # The newlines a template puts after a thinking block or a call are layout.
            text = text.lstrip("\n")
            self.region_ended = not text
        if not text:
            return
        self.emitted = True
        if parts and parts[-1].kind == kind and kind != "tool_call":
            parts[-1].text += text
        else:
            parts.append(Part(kind, text))

    def _end_tool_region(self, body: str, raw: str, parts: list[Part]) -> None:
        calls = parse_calls(self.tools, body, self.parameters)
        if calls is None:  # not a call after all: the user sees the text
            self._emit("content", raw, parts)
            return
        for call in calls:
            self.calls.append(call)
            parts.append(Part("tool_call", call=call))
            self.emitted = True

    def feed(self, text: str) -> list[Part]:
        self.buffer += text
        parts: list[Part] = []
        while True:
            if self.state == "reasoning":
                close, label = self.think.close, self.think.label
                if self.label_pending and label:
                    if len(self.buffer) < len(label) and label.startswith(self.buffer):
                        return parts  # may still be the label
                    if self.buffer.startswith(label):
                        self.buffer = self.buffer[len(label):]
                self.label_pending = False
                end = self.buffer.find(close)
                if end < 0:
                    keep = _marker_prefix(self.buffer, [close])
                    self._emit("reasoning", self.buffer[: len(self.buffer) - keep], parts)
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return parts
                self._emit("reasoning", self.buffer[:end], parts)
                self.buffer = self.buffer[end + len(close):]
                self.state, self.region_ended = "content", True
            elif self.state == "tool":
                close = self.tools.close
                end = self.buffer.find(close) if close else -1
                if end < 0:
                    return parts  # the region is held whole until it ends
                body = self.buffer[:end]
                self._end_tool_region(body, self.tools.open + body + close, parts)
                self.buffer = self.buffer[end + len(close):]
                self.state, self.region_ended = "content", True
            else:
                markers = self._opening_markers()
                found = [(self.buffer.find(m), m, state) for m, state in markers]
                found = [f for f in found if f[0] >= 0]
                if not found:
                    keep = _marker_prefix(self.buffer, [m for m, _ in markers])
                    self._emit("content", self.buffer[: len(self.buffer) - keep], parts)
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return parts
                at, marker, state = min(found)
                before = self.buffer[:at]
                if state == "reasoning" and not self.emitted and not before.strip():
                    before = ""  # layout before the thoughts (GLM's "\n<think>")
                self._emit("content", before, parts)
                self.buffer = self.buffer[at + len(marker):]
                self.state, self.label_pending = state, state == "reasoning"

    def finish(self) -> list[Part]:
        parts = self.feed("")
        if self.state == "reasoning" and self.label_pending:  # it ended inside the label
            self.buffer, self.label_pending = "", False
        rest, self.buffer = self.buffer, ""
        if self.state == "tool":
            self._end_tool_region(rest, self.tools.open + rest, parts)
        else:
            self._emit(self.state, rest, parts)
        return parts


def _marker_prefix(text: str, markers: list[str]) -> int:
    """How many characters at the end of ``text`` may begin one of ``markers``."""
    hold = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:k]):
                hold = k
                break
    return hold
