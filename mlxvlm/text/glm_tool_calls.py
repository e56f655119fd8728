"""GLM-4.5V / 4.6V's tool calls: ``<tool_call>NAME`` then, for each argument,
``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`` (the Hub's templates put a newline
after the name and after each tag pair), then ``</tool_call>``. A value is written as it
is when it is a string and as JSON otherwise (the template's ``tojson`` unless the value
is a string), so reading one back needs the function's parameters: text under a
string-only schema stays text (``"3"`` is not 3), anything else is read as JSON where it
parses."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
MARKERS = (KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)

_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"[^\s<>{}\[\]\"']+")


def written_as_text(schema: Any) -> bool:
    """Whether every value ``schema`` allows is a string, which the template writes
    without quotes."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or kind == ["string"]:
        return True
    if kind is None:
        allowed = schema.get("enum", [schema["const"]] if "const" in schema else None)
        return bool(allowed) and all(isinstance(v, str) for v in allowed)
    return False


def parse_call(body: str, parameters: Mapping[str, Any] | None = None
               ) -> tuple[str, dict[str, Any]] | None:
    """The function's name and arguments in one call's text (between ``<tool_call>`` and
    ``</tool_call>``); None where the text is not a call in this format. ``parameters``:
    the functions' parameter schemas by name, to read each value as its type."""
    start = body.find(KEY_OPEN)
    name = (body if start < 0 else body[:start]).strip()
    if not _NAME.fullmatch(name):
        return None
    properties = ((parameters or {}).get(name) or {}).get("properties") or {}
    arguments: dict[str, Any] = {}
    at = len(body) if start < 0 else start
    while at < len(body):
        match = _ARGUMENT.match(body, at)
        if match is None:
            break
        key, text = match.group(1).strip(), match.group(2)
        if not key or key in arguments:
            return None
        arguments[key] = _value(text, properties.get(key))
        at = match.end()
    if body[at:].strip():  # anything else in the call: not this format
        return None
    return name, arguments


def _value(text: str, schema: Any) -> Any:
    if written_as_text(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text  # a string the schema did not say was one

