"""The grammars (llguidance's Lark, with ``%json`` schemas) of a tool-call answer, in a
family's format: for ``tool_choice`` "required" or a named function, an answer that is
only calls; for "auto" on the generic format, free text in which a call, once its marker
is written, must be whole and valid (a lazy grammar, as llama-server's). A call's
arguments validate against its function's parameters, ``$defs``/``$ref`` included."""

from __future__ import annotations

import json
import re
from typing import Any

from mlxvlm.sampling.constrained import ConstraintError
from mlxvlm.text import glm_tool_calls
from mlxvlm.text.answer_parts import GEMMA4_TOOLS, GLM_TOOLS, ToolFormat, added_token_ids

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# A call's JSON laid out as json.dumps writes it (and chat templates' tojson, so as the
# models saw calls in training): no free whitespace, which a model could otherwise
# spend its whole budget on inside a call.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keywords whose values are data, not schemas (a "$ref" in them is not a reference), and
# those whose values map names to schemas (any name, "const" included, is a schema).
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})


def calls_schema(tools: list) -> dict:
    """The JSON schema of one call, ``{"name": ..., "arguments": {...}}``, to any of
    ``tools``. Parameters that refer within themselves (pydantic's ``#/$defs/P``, or
    ``#``) go under the root's ``$defs``, their references moved with them, since nested
    under ``arguments`` those pointers would name the call's schema instead."""
    definitions: dict[str, Any] = {}
    calls = []
    for index, tool in enumerate(tools):
        parameters = tool.function.parameters or EMPTY_PARAMETERS
        key = f"arguments_{index}"
        rebased = _rebased(parameters, f"#/$defs/{key}")
        if rebased != parameters:
            definitions[key] = rebased
            parameters = {"$ref": f"#/$defs/{key}"}
        calls.append({"type": "object",
                      "properties": {"name": {"const": tool.function.name},
                                     "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "$defs": definitions} if definitions else schema


def _rebased(node: Any, base: str, names_schemas: bool = False) -> Any:
    """``node`` with each local reference (``#...``) moved under ``base``."""
    if isinstance(node, list):
        return [_rebased(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    moved = {}
    for key, value in node.items():
        if names_schemas:
            moved[key] = _rebased(value, base)
        elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            moved[key] = value
        else:
            moved[key] = _rebased(value, base, names_schemas=key in _SCHEMA_MAPS)
    return moved


def _json(schema: dict) -> str:
    """``schema`` as a Lark grammar's JSON rule, in the calls' layout."""
    return f"%json {json.dumps({**schema, 'x-guidance': _LAYOUT})}"


def literal(text: str, tokenizer: Any) -> str:
    """``text`` in the grammar: a token the tokenizer added by its id (llguidance holds
    every added token, special or not, as a special one, whose bytes never match text:
    GLM's ``<tool_call>``, Qwen's), anything else as a string."""
    added = added_token_ids(tokenizer)
    if text in added:
        return f"<[{added[text]}]>"
    return json.dumps(text)


def calls_grammar(fmt: ToolFormat, tools: list, tokenizer: Any, several: bool) -> str:
    """Answers that are only calls to ``tools`` in ``fmt`` (one, or ``several``)."""
    if fmt is GEMMA4_TOOLS:
        return _gemma4_calls_grammar(tools, tokenizer, several)
    if fmt is GLM_TOOLS:
        return _glm_calls_grammar(tools, tokenizer, several)
    schema = calls_schema(tools)
    opening = literal(fmt.open, tokenizer)
    if fmt.close is None:  # Mistral: [TOOL_CALLS] then a JSON list of calls
        definitions = schema.pop("$defs", None)
        listed = {"type": "array", "items": schema, "minItems": 1}
        if not several:
            listed["maxItems"] = 1
        if definitions:
            listed["$defs"] = definitions
        return f"start: {opening} calls\ncalls: {_json(listed)}\n"
    more = ' ("\\n" block)*' if several else ""
    return (f"start: block{more}\n"
            f'block: {opening} "\\n" call "\\n" {literal(fmt.close, tokenizer)}\n'
            f"call: {_json(schema)}\n")


def text_or_calls_grammar(fmt: ToolFormat, tools: list, tokenizer: Any,
                          several: bool) -> str:
    """Free text, in which ``fmt``'s opening marker starts a call that must be whole and
    valid (then text again); at most one call unless ``several``. The opening is a lazy
    lexeme: text ends at its first occurrence, and no text after it may hold it."""
    opening = literal(fmt.open, tokenizer)
    head = (f"head: TEXT {opening}" if opening.startswith("<[")  # a special token
            else f"head[lazy]: TEXT {opening}")
    marker = re.escape(fmt.open).replace("/", "\\/")
    return (f"start: call{'*' if several else '?'} TEXT\n"
            f'call: head "\\n" body "\\n" {literal(fmt.close, tokenizer)}\n'
            f"{head}\n"
            f"body: {_json(calls_schema(tools))}\n"
            f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/\n")


def _gemma4_calls_grammar(tools: list, tokenizer: Any, several: bool) -> str:
    """Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>`` with the arguments as JSON
    under the function's parameters (Gemma's own quoting has no schema grammar; the
    parser reads either). Each function's parameters are a schema's root here, so
    their references resolve as written."""
    fmt = GEMMA4_TOOLS
    rules = [f"start: block{'+' if several else ''}",
             f"block: {literal(fmt.open, tokenizer)} call {literal(fmt.close, tokenizer)}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        parameters = tool.function.parameters or EMPTY_PARAMETERS
        rules.append(f"call_{i}: {json.dumps('call:' + tool.function.name)} arguments_{i}")
        rules.append(f"arguments_{i}: {_json(parameters)}")
    return "\n".join(rules) + "\n"


def _glm_calls_grammar(tools: list, tokenizer: Any, several: bool) -> str:
    """GLM's calls laid out as the Hub's template writes them
    (``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...
    </tool_call>``, calls apart by a newline): the function's properties in their
    order, the required ones always, each value under its own schema. Parameters that
    name no properties take any keys with JSON values, unless they forbid other keys."""
    def tag(text: str) -> str:
        return literal(text, tokenizer)

    value_close = re.escape(glm_tool_calls.VALUE_CLOSE).replace("/", "\\/")
    more = ' ("\\n" block)*' if several else ""
    rules = [f"start: block{more}",
             f"block: {tag(GLM_TOOLS.open)} call {tag(GLM_TOOLS.close)}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
             "KEY: /[^<>\\n]+/"]

    def argument(key: str, value: str) -> str:
        return (f"{tag(glm_tool_calls.KEY_OPEN)} {key} {tag(glm_tool_calls.KEY_CLOSE)} "
                f'"\\n" {tag(glm_tool_calls.VALUE_OPEN)} {value} '
                f'{tag(glm_tool_calls.VALUE_CLOSE)} "\\n"')

    for i, tool in enumerate(tools):
        parameters = tool.function.parameters or EMPTY_PARAMETERS
        properties = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        definitions = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
        arguments = []
        for j, (key, schema) in enumerate(properties.items()):
            value = _glm_value(schema, definitions, f"{i}_{j}", value_close, rules)
            rules.append(f"arg_{i}_{j}: {argument(json.dumps(key), value)}")
            arguments.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
        if not properties and parameters.get("additionalProperties") is not False:
            rules.append(f"arg_{i}_any: {argument('KEY', f'value_{i}_any')}")
            rules.append(f"value_{i}_any: {_json({})}")
            arguments.append(f"arg_{i}_any*")
        rules.append(f'call_{i}: {json.dumps(tool.function.name)} "\\n" '
                     + " ".join(arguments))
    return "\n".join(rule.rstrip() for rule in rules) + "\n"


def _glm_value(schema: Any, definitions: dict, suffix: str, value_close: str,
               rules: list[str]) -> str:
    """One argument's value in the grammar: where the schema allows only strings, text
    as the template writes it (the values it lists, else text without the closing tag
    within the schema's lengths); else JSON under the schema, with the parameters'
    ``$defs`` beside it for its references. The rules it needs go into ``rules``, named
    after ``suffix``. A string ``pattern`` has no text grammar here: refused rather
    than not enforced."""
    if not glm_tool_calls.written_as_text(schema):
        schema = schema if isinstance(schema, dict) else {}
        rules.append(f"json_{suffix}: {_json({**schema, **definitions})}")
        return f"json_{suffix}"
    allowed = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if allowed:
        return "(" + " | ".join(json.dumps(value) for value in allowed) + ")"
    if "pattern" in schema:
        raise ConstraintError("a string argument's \"pattern\" cannot be enforced in GLM's "
                              "tool-call format (its strings are not quoted)")
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    length = "*" if (low, high) == (0, None) else f"{{{low},{'' if high is None else int(high)}}}"
    rules.append(f"TEXT_{suffix}: /(.|\\n){length}/ & ~/(.|\\n)*{value_close}(.|\\n)*/")
    return f"TEXT_{suffix}"
