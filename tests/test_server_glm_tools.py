"""GLM-4.5V / 4.6V's tool calls (``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n
<arg_value>VALUE</arg_value>\\n...</tool_call>``, a string value as it is, others as
JSON): the template names the format, calls come back as each API's calls (whole and
streamed), and "required" or a named function is enforced by a grammar in this format.

The expected calls are the tiny template's own rendering of an assistant turn's
``tool_calls`` (tests/tiny/glm4v.py, written after GLM-4.6V's template): what the model
was taught to write is read back as the calls it came from. The tiny GLM is random: a
scripted logits processor (tests/scripted_tokens.py) makes it answer chosen tokens."""

from __future__ import annotations

import json

import httpx
import jsonschema
import llguidance
import openai
import pytest
from scripted_tokens import script_tokens
from server_harness import MODEL_ID, LiveServer
from server_process import ServerProcess
from test_server_tools import TEMPLATE as HERMES_TEMPLATE

import mlxvlm
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.sampling.constrained import ConstraintError, lark_constraint
from mlxvlm.server.schemas import Tool
from mlxvlm.server.tool_grammars import calls_grammar
from mlxvlm.text.answer_parts import GLM_TOOLS, HERMES, AnswerSplitter, tool_format

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "where": {"$ref": "#/$defs/Place"}},
        "required": ["city", "unit"], "additionalProperties": False,
        "$defs": {"Place": {"type": "object", "properties": {"lat": {"type": "number"}},
                            "required": ["lat"], "additionalProperties": False}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
# Short enough for the tiny model's 1,024 positions with TIME, the random model's call
# bounded.
BOUNDED = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
BOUNDED_PARAMETERS = {t["function"]["name"]: t["function"]["parameters"]
                      for t in (BOUNDED, TIME)}
# A string that reads as a number stays a string; tags and braces are text in a value.
ARGUMENTS = {"city": "3", "days": 3, "metric": True, "unit": "celsius",
             "where": {"lat": 48.5}}
TIME_ARGUMENTS = {"zone": "UTC"}
ASK = [{"role": "user", "content": "Weather?"}]


def rendered_calls(tokenizer, *calls: tuple[str, dict]) -> str:
    """The calls as the template writes an assistant turn's ``tool_calls``."""
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in calls]}
    before = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    text = tokenizer.apply_chat_template(ASK + [turn], tokenize=False)
    assert text.startswith(before)
    return text[len(before):].split("</think>\n", 1)[1].lstrip("\n")


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("glm4v", "hub"))


@pytest.fixture(scope="module")
def call_text(loaded):
    return rendered_calls(loaded[1].tokenizer, ("get_weather", ARGUMENTS))


def split(pieces: list[str]):
    splitter = AnswerSplitter(GLM_TOOLS, True, parameters=PARAMETERS)
    parts = [p for piece in pieces for p in splitter.feed(piece)] + splitter.finish()
    text = "".join(p.text for p in parts if p.kind == "content")
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    calls = [(p.call.name, json.loads(p.call.arguments)) for p in parts if p.kind == "tool_call"]
    return reasoning, text, calls


def test_the_template_names_the_format(loaded):
    tokenizer = loaded[1].tokenizer
    assert tool_format(loaded[1].chat_template) is GLM_TOOLS
    assert tool_format(HERMES_TEMPLATE) is HERMES  # Hermes' <tool_call> alone is Hermes
    prompt = tokenizer.apply_chat_template(ASK, tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
    assert '"name": "get_weather"' in prompt and "<arg_key>{arg-key-1}</arg_key>" in prompt
    for tag in GLM_TOOLS.markers:  # the tags are text the detokenizer keeps
        ids = tokenizer.encode(tag, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.decode(ids) == tag


def test_calls_are_read_back_at_every_split(loaded, call_text):
    both = rendered_calls(loaded[1].tokenizer, ("get_weather", ARGUMENTS),
                          ("get_time", TIME_ARGUMENTS))
    answer = "<think>Look it up.</think>\nLet me see.\n" + both
    expected = ("Look it up.", "Let me see.\n",
                [("get_weather", ARGUMENTS), ("get_time", TIME_ARGUMENTS)])
    assert split([answer]) == expected
    for at in range(len(answer) + 1):
        assert split([answer[:at], answer[at:]]) == expected, at
    assert split(list(answer)) == expected
    assert split([call_text]) == ("", "", [("get_weather", ARGUMENTS)])


@pytest.mark.parametrize("text", [
    "<tool_call>get weather\n</tool_call>",  # no name
    "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis</tool_call>",  # no value tags
    ("<tool_call>get_weather\n<arg_key>a</arg_key><arg_value>1</arg_value>\n"
     "<arg_key>a</arg_key><arg_value>2</arg_value></tool_call>"),  # a key twice
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # Hermes' JSON
])
def test_what_is_not_a_call_is_text(text):
    assert split(["Hi. " + text]) == ("", "Hi. " + text, [])


def test_the_compact_layout_is_read_too():
    """Later GLM templates write a call on one line (no newline after the name or tags)."""
    compact = ("<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value>"
               "</tool_call>")
    assert split([compact]) == ("", "", [("get_time", TIME_ARGUMENTS)])


def test_a_call_without_schema_reads_values_as_json_where_they_parse():
    splitter = AnswerSplitter(GLM_TOOLS, None)
    [part] = splitter.feed("<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>[1, 2]</arg_value>\n"
                           "<arg_key>s</arg_key>\n<arg_value>a b</arg_value>\n</tool_call>")
    assert json.loads(part.call.arguments) == {"n": [1, 2], "s": "a b"}


def test_a_call_read_back_renders_as_it_was_written(loaded, call_text):
    """The call the parser read, sent back as the assistant's ``tool_calls`` (OpenAI's
    JSON arguments) with its result, renders as the model wrote it, the result after
    ``<|observation|>``."""
    from mlxvlm.prompt import render_chat
    from mlxvlm.server.chat_completions import to_messages
    from mlxvlm.server.schemas import ChatCompletionRequest
    from mlxvlm.server.tools import AnswerPlan

    [call] = split([call_text])[2]
    chat = ChatCompletionRequest.model_validate({"model": MODEL_ID, "tools": [WEATHER],
                                                 "messages": ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": call[0], "arguments": json.dumps(call[1])}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]})
    plan = AnswerPlan(chat, loaded[1])
    text = render_chat(loaded[1], plan.conversation(to_messages(chat)), plan.template_options)
    assert "\n" + call_text + "<|observation|>\n<tool_response>\nsunny, 21\n</tool_response>" in text
    assert text.count('"name": "get_weather"') == 1  # the tools' section


def grammar(loaded, tools, several=True):
    processor = loaded[1]
    tools = [Tool.model_validate(t) for t in tools]
    return lark_constraint(processor.tokenizer, eos_token_ids(processor),
                           calls_grammar(GLM_TOOLS, tools, processor.tokenizer, several), "t")


def takes(constraint, tokenizer, text: str) -> bool:
    matcher = llguidance.LLMatcher(constraint.lltokenizer, constraint.grammar, log_level=0)
    return all(matcher.consume_token(t)
               for t in tokenizer.encode(text, add_special_tokens=False))


def test_the_grammar_takes_the_templates_calls_and_nothing_else(loaded, call_text):
    tokenizer = loaded[1].tokenizer
    many, one = grammar(loaded, TOOLS), grammar(loaded, TOOLS, several=False)
    two = rendered_calls(tokenizer, ("get_weather", ARGUMENTS), ("get_time", TIME_ARGUMENTS))
    minimal = rendered_calls(tokenizer, ("get_weather", {"city": "Paris", "unit": "celsius"}))
    for text in (call_text, two, minimal):
        assert takes(many, tokenizer, text), text
    assert takes(one, tokenizer, call_text) and not takes(one, tokenizer, two)
    text = calls_grammar(GLM_TOOLS, [Tool.model_validate(TIME)], tokenizer, False)
    for tag in GLM_TOOLS.markers:  # added tokens, which llguidance matches by id only
        assert f"<[{tokenizer.convert_tokens_to_ids(tag)}]>" in text
    for wrong in ({"city": "Paris"},  # "unit" is required
                  {"city": "Paris", "unit": "kelvin"},
                  {"city": "Paris", "unit": "celsius", "days": "3"},
                  {"city": "x" * 25, "unit": "celsius"},  # maxLength
                  {"city": "Paris", "unit": "celsius", "where": {"lat": "n"}},  # $ref
                  {"city": "Paris", "unit": "celsius", "other": 1}):
        text = rendered_calls(tokenizer, ("get_weather", wrong))
        assert not takes(many, tokenizer, text), wrong
    assert not takes(many, tokenizer, "Hi" + call_text)
    assert not takes(many, tokenizer, '<tool_call>\n{"name": "get_time"')




@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(*loaded) as live:
        yield live


def test_a_scripted_call_comes_back_on_each_api(server, loaded, call_text, monkeypatch):
    """(The tiny model's 1,024 positions hold one tool's prompt and the call.) The model
    thinks, then calls: OpenAI's ``tool_calls`` (whole and streamed), the
    Responses API's ``function_call`` item and Anthropic's streamed ``tool_use``."""
    tokenizer = loaded[1].tokenizer
    script_tokens(monkeypatch, tokenizer.encode("\n<think>I should look.</think>\n" + call_text)
                  + [tokenizer.convert_tokens_to_ids("<|observation|>")])
    client = server.client()
    choice = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER],
                                            max_tokens=400).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.reasoning_content == "I should look."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                          ARGUMENTS)
    names, arguments, finish = {}, {}, None
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER],
                                                max_tokens=400, stream=True):
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names[piece.index] = piece.function.name or names.get(piece.index)
            arguments[piece.index] = arguments.get(piece.index, "") + (
                piece.function.arguments or "")
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert finish == "tool_calls" and names == {0: "get_weather"}
    assert json.loads(arguments[0]) == ARGUMENTS

    response = client.responses.create(model=MODEL_ID, input="Weather?", max_output_tokens=400,
                                       tools=[{"type": "function", **t["function"]}
                                              for t in [WEATHER]])
    [item] = [i for i in response.output if i.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments) == ARGUMENTS
    streamed = "".join(event.delta for event in client.responses.create(
        model=MODEL_ID, input="Weather?", max_output_tokens=400, stream=True,
        tools=[{"type": "function", **WEATHER["function"]}])
        if event.type == "response.function_call_arguments.delta")
    assert json.loads(streamed) == ARGUMENTS

    claude_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                    for t in [WEATHER]]
    events = []
    with httpx.stream("POST", server.base_url + "/v1/messages", timeout=120, json={
            "model": MODEL_ID, "max_tokens": 400, "messages": ASK, "tools": claude_tools,
            "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    [start] = [e for e in events if e["type"] == "content_block_start"
               and e["content_block"]["type"] == "tool_use"]
    assert start["content_block"]["name"] == "get_weather"
    streamed = "".join(e["delta"]["partial_json"] for e in events
                       if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "input_json_delta")
    assert json.loads(streamed) == ARGUMENTS
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == [
        "tool_use"]


def test_a_string_pattern_is_refused_not_ignored(loaded, server):
    patterned = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}}}}
    with pytest.raises(ConstraintError, match="pattern"):
        grammar(loaded, [patterned])
    with pytest.raises(openai.BadRequestError, match="pattern") as refused:
        server.client().chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=8,
                                                tools=[patterned], tool_choice="required")
    assert refused.value.body["param"] == "tools"


def test_forced_calls_through_the_server_entry_point(tiny_checkpoints):
    """``python -m mlxvlm.server`` on the tiny GLM-4.6V-Flash, with the official client:
    "required" and a named function make the random model's answer GLM calls whose
    arguments validate against the functions' parameters."""
    with ServerProcess("--model", str(tiny_checkpoints.path("glm4v", "hub")),
                       "--served-model-name", "glm") as process:
        client = process.openai_client()
        for choice, names in (("required", {"get_weather", "get_time"}),
                              ({"type": "function", "function": {"name": "get_time"}},
                               {"get_time"})):
            reply = client.chat.completions.create(
                model="glm", messages=ASK, tools=[BOUNDED, TIME], tool_choice=choice,
                max_tokens=200,
                temperature=1.0, seed=3).choices[0]
            assert reply.finish_reason == "tool_calls" and reply.message.tool_calls, reply
            for call in reply.message.tool_calls:
                assert call.function.name in names
                jsonschema.validate(json.loads(call.function.arguments),
                                    BOUNDED_PARAMETERS[call.function.name])
