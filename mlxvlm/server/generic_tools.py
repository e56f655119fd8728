"""Tools on a model whose chat template renders none (most vision-language models), as
llama-server and vLLM serve them: the tools are described in the system turn (in the
first user turn where the template takes no system turn) with one call format, the JSON
object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>`` (``answer_parts.GENERIC_TOOLS``, which the tool grammars enforce and the
answer's splitter reads); a conversation's earlier calls and tool results become text in
the same format, so that any template renders them."""

from __future__ import annotations

import json
from typing import Any

from mlxvlm.text.answer_parts import GENERIC_TOOLS

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

Message = dict[str, Any]


def describe_tools(tools: list, choice: Any, parallel: bool) -> str:
    """The tools and how to call them, for the prompt; ``choice``: "auto", "required" or
    the name of the one function to call. Short, as a small model's context is."""
    lines = ["# Tools",
             "Functions you can call, one JSON line each (name, description, parameters as "
             "JSON schema):"]
    for tool in tools:
        function = tool.function
        described = {"name": function.name, "description": function.description,
                     "parameters": function.parameters or {"type": "object",
                                                           "properties": {}}}
        lines.append(json.dumps({k: v for k, v in described.items() if v is not None},
                                ensure_ascii=False))
    lines += ["To call one, write:",
              GENERIC_TOOLS.open,
              '{"name": "<name>", "arguments": {<arguments as JSON>}}',
              GENERIC_TOOLS.close,
              _choice_line(choice, parallel),
              f"Results come back as {RESPONSE_OPEN}...{RESPONSE_CLOSE}."]
    return "\n".join(lines)


def _choice_line(choice: Any, parallel: bool) -> str:
    if choice == "auto":
        many = "several calls, one block each" if parallel else "at most one call"
        return f"Call a function only when it helps ({many}); otherwise answer in text."
    if choice == "required":
        return ("Answer with one or more calls, one block each." if parallel
                else "Answer with exactly one call.")
    return f"Answer by calling {choice}."


def calls_as_text(calls: list[dict]) -> str:
    """An assistant turn's calls (chat templates' shape: arguments as a mapping) in the
    generic format."""
    return "\n".join(
        f"{GENERIC_TOOLS.open}\n"
        + json.dumps({"name": call["function"]["name"],
                      "arguments": call["function"]["arguments"]}, ensure_ascii=False)
        + f"\n{GENERIC_TOOLS.close}" for call in calls)


def as_plain_turns(messages: list[Message]) -> list[Message]:
    """``messages`` (``chat.to_messages``' shape) with every assistant turn's calls as
    text after its content and every tool result as a user turn holding
    ``<tool_response>`` blocks; results that follow each other share one user turn, with
    the user's next turn too, so that roles still alternate."""
    turns: list[Message] = []
    merge_into_last = False  # the last turn holds tool results
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            entry = {k: v for k, v in message.items() if k != "tool_calls"}
            entry["content"] = _joined(message.get("content"),
                                       calls_as_text(message["tool_calls"]))
            turns.append(entry)
            merge_into_last = False
        elif role == "tool":
            result = _joined(_joined(RESPONSE_OPEN, message.get("content"), sep="\n"),
                             RESPONSE_CLOSE, sep="\n")
            if merge_into_last:
                turns[-1]["content"] = _joined(turns[-1]["content"], result)
            else:
                turns.append({"role": "user", "content": result})
            merge_into_last = True
        elif role == "user" and merge_into_last:
            turns[-1]["content"] = _joined(turns[-1]["content"], message.get("content"))
            merge_into_last = False
        else:
            turns.append(message)
            merge_into_last = False
    return turns


def with_description(messages: list[Message], description: str,
                     takes_system: bool) -> list[Message]:
    """``messages`` with the tools' ``description`` after the system turn's text (a
    system turn of its own where there is none), or before the first user turn's where
    the template takes no system turn."""
    messages = list(messages)
    if takes_system:
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0],
                           "content": _joined(messages[0].get("content"), description,
                                              sep="\n\n")}
        else:
            messages.insert(0, {"role": "system", "content": description})
        return messages
    for index, message in enumerate(messages):
        if message["role"] == "user":
            messages[index] = {**message, "content": _joined(
                description, message.get("content"), sep="\n\n")}
            return messages
    messages.insert(0, {"role": "user", "content": description})
    return messages


def _joined(first: Any, second: Any, sep: str = "\n") -> Any:
    """Two contents (text, a list of parts, or None) as one: text where both are text,
    else a list of parts."""
    if not first:
        return second or ""
    if not second:
        return first
    if isinstance(first, str) and isinstance(second, str):
        return first + sep + second
    parts = _parts(first)
    if parts[-1].get("type") == "text":
        parts[-1] = {**parts[-1], "text": parts[-1]["text"] + sep}
    else:
        parts.append({"type": "text", "text": sep})
    return parts + _parts(second)


def _parts(content: Any) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
