"""Gemma 4's tool calls (``<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>``,
special tokens the detokenizer drops by default) come back as OpenAI ``tool_calls``
(whole and streamed, ``finish_reason`` "tool_calls") with the arguments as JSON; an
answer without the marker is plain text; "required" and a named function are enforced by
a grammar
(no grammar for this format).

The tiny Gemma 4 is random: a scripted logits processor (tests/scripted_tokens.py) makes
it answer with chosen tokens through the real engine and detokenizer. Its template gets
the Hub template's tool rendering (declarations in the system turn, earlier calls in
the call syntax), which is what names the format."""

from __future__ import annotations

import json

import jsonschema

import openai
import pytest
from scripted_tokens import script_tokens
from server_harness import MODEL_ID, LiveServer
from tiny.gemma4 import CHAT_TEMPLATE

import mlxvlm
from mlxvlm.text.answer_parts import GEMMA4_TOOLS, AnswerSplitter, marker_ids, tool_format

SYSTEM = "{%- if thinking or messages[0]['role'] == 'system' -%}"
CONTENT = "{%- if message['content'] is string -%}"
TOOLS_TEMPLATE = CHAT_TEMPLATE.replace(SYSTEM, (
    "{%- if thinking or tools or messages[0]['role'] == 'system' -%}")).replace(
    "<|think|>{% endif %}", (
        "<|think|>{% endif %}{%- for tool in tools or [] -%}<|tool>declaration:"
        "{{ tool['function']['name'] }}{{ tool['function'] | tojson }}<tool|>{%- endfor -%}")
).replace(CONTENT, (
    "{%- if message['tool_calls'] -%}{%- for call in message['tool_calls'] -%}"
    "<|tool_call>call:{{ call['function']['name'] }}{{ '{' }}"
    "{%- for key, value in call['function']['arguments'].items() -%}"
    "{{ key }}:<|\"|>{{ value }}<|\"|>{{ ',' if not loop.last }}{%- endfor -%}{{ '}' }}<tool_call|>"
    "{%- endfor -%}{%- endif -%}" + CONTENT))
assert TOOLS_TEMPLATE.count("<|tool_call>") == 1 and "tools or messages" in TOOLS_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris, "the" {city}<|"|>,days:3,metric:true}<tool_call|>'
ARGUMENTS = {"city": 'Paris, "the" {city}', "days": 3, "metric": True}
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    model, processor = mlxvlm.load(tiny_checkpoints.path("gemma4", "hub"))
    processor.chat_template = processor.tokenizer.chat_template = TOOLS_TEMPLATE
    return model, processor


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(*loaded) as live:
        yield live


def answer(monkeypatch, processor, text: str) -> None:
    tokenizer = processor.tokenizer
    script_tokens(monkeypatch, tokenizer.encode(text, add_special_tokens=False)
                  + [tokenizer.eos_token_id])


def test_the_template_names_the_format_and_its_markers_are_kept(loaded):
    processor = loaded[1]
    assert tool_format(processor.chat_template) is GEMMA4_TOOLS
    assert tool_format(CHAT_TEMPLATE) is None
    rendered = processor.apply_chat_template(ASK, tools=[WEATHER], tokenize=False,
                                             add_generation_prompt=True)
    assert "<|tool>declaration:get_weather{" in rendered
    tokenizer = processor.tokenizer
    assert marker_ids(tokenizer, GEMMA4_TOOLS) == {
        tokenizer.convert_tokens_to_ids(t) for t in ("<|tool_call>", "<tool_call|>", '<|"|>')}
    ids = tokenizer.encode(CALL, add_special_tokens=False)
    assert "<|tool_call>" not in tokenizer.decode(ids, skip_special_tokens=True)


def test_a_call_comes_back_as_tool_calls(server, loaded, monkeypatch):
    answer(monkeypatch, loaded[1], CALL)
    client = server.client()
    choice = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER],
                                            max_tokens=64).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS

    names, arguments, finish, content = {}, {}, None, []
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER],
                                                max_tokens=64, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for piece in delta.tool_calls or []:
            if piece.function.name:
                names[piece.index] = piece.function.name
            arguments[piece.index] = arguments.get(piece.index, "") + (
                piece.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not "".join(content)
    assert names == {0: "get_weather"} and json.loads(arguments[0]) == ARGUMENTS


def test_text_without_the_marker_is_unchanged(server, loaded, monkeypatch):
    text = "It is {sunny}: 3 days."
    answer(monkeypatch, loaded[1], text)
    choice = server.client().chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], max_tokens=64).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == text


@pytest.mark.parametrize("seed", [1, 2])
def test_required_and_named_give_calls_that_validate(server, seed):
    """"required" and a named function: the grammar makes even the random model's answer
    one Gemma 4 call (or several) with JSON arguments valid under the parameters."""
    client = server.client()
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
            max_tokens=160, temperature=1.0, seed=seed).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
        for call in reply.message.tool_calls:
            assert call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments),
                                PARAMETERS[call.function.name])


def split(pieces: list[str]) -> list[tuple[str, str]]:
    splitter = AnswerSplitter(GEMMA4_TOOLS, None)
    parts = [p for piece in pieces for p in splitter.feed(piece)] + splitter.finish()
    return [(p.kind, p.call.name + p.call.arguments if p.call else p.text) for p in parts]


def test_split_holds_a_partial_marker_back():
    pieces = ["Sure.", "<|tool", "_call>call:f{a:<|\"", "|>x}<|\"|>,b:[1,2]}<tool_",
              "call|>", "<|tool_call>call:g{}<tool_call|>"]
    assert split(pieces) == [("content", "Sure."), ("tool_call", 'f{"a": "x}", "b": [1, 2]}'),
                             ("tool_call", "g{}")]
    splitter = AnswerSplitter(GEMMA4_TOOLS, None)
    assert [p.text for p in splitter.feed("Hi <|tool")] == ["Hi "]  # held back
    assert [p.text for p in splitter.finish()] == ["<|tool"]
    # A region that is not a call stays text.
    assert split(["<|tool_call>nonsense<tool_call|>"]) == [
        ("content", "<|tool_call>nonsense<tool_call|>")]
