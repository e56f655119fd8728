"""Tools on a model whose chat template renders none (the tiny Qwen2-VL's, as Qwen2-VL,
LLaVA, SmolVLM and PaliGemma ship): the tools are described in the prompt with one call
format (``<tool_call>{"name", "arguments"}</tool_call>``), "required" and a named function
are enforced by a grammar whatever the random model would say, "auto" lets it answer text
or a call that the grammar keeps valid once begun, and earlier calls and results go back
as text in that format. Through chat completions, Responses and Messages (the official
clients) and through ``python -m mlxvlm.server`` itself; arguments are checked with
``jsonschema`` against each function's parameters, pydantic-written ``$defs`` included."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import anthropic
import httpx
import jsonschema
import llguidance
import pytest
from pydantic import BaseModel
from scripted_tokens import script_tokens
from server_harness import MODEL_ID, LiveServer, png_data_url, user
from server_process import ServerProcess
from test_server_tools import TEMPLATE as HERMES_TEMPLATE
from tiny import make_image
from tiny.llava import MISTRAL_TEMPLATE
from tiny.qwen import CHAT_TEMPLATE as QWEN_TEMPLATE

import mlxvlm
from mlxvlm.sampling.constrained import lark_constraint
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.models.paligemma import CHAT_TEMPLATE as PALIGEMMA_TEMPLATE
from mlxvlm.prompt import render_chat
from mlxvlm.text.answer_parts import GENERIC_TOOLS, marker_ids
from mlxvlm.server.chat_completions import to_messages
from mlxvlm.server.schemas import ChatCompletionRequest, Tool
from mlxvlm.server.template_traits import template_traits
from mlxvlm.server.tool_grammars import calls_schema, text_or_calls_grammar
from mlxvlm.server.tools import AnswerPlan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False}}}


class Box(BaseModel):
    side: int
    colour: str


class Shelf(BaseModel):
    top: Box
    more: list[Box]


PLACE = {"type": "function", "function": {"name": "place",
                                          "parameters": Shelf.model_json_schema()}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME, PLACE)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
DEMO = Path(__file__).parent.parent / "examples" / "shapes-vlm"
PARIS = {"city": "Paris", "unit": "celsius"}
EARLIER = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(*loaded) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=60.0)


class TemplateOnly:
    """A processor with another chat template over the same tokenizer."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer, self.chat_template = tokenizer, template

    def apply_chat_template(self, messages, **options):
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                                  **options)


# Hub templates that take no system turn and raise where roles do not alternate (Gemma's,
# Mistral's LLaVA), as a tiny one.
ALTERNATING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ raise_exception('no system role') }}{%- endif -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{%- endif -%}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def plan_and_prompt(processor, messages, **request):
    chat = ChatCompletionRequest.model_validate({"model": MODEL_ID, "messages": messages,
                                                 **request})
    plan = AnswerPlan(chat, processor)
    return plan, render_chat(processor, plan.conversation(to_messages(chat)),
                             plan.template_options)


@pytest.mark.parametrize("template, renders_tools, takes_system", [
    (QWEN_TEMPLATE, False, True), (HERMES_TEMPLATE, True, True),
    (PALIGEMMA_TEMPLATE, False, False),  # raises on a system turn
    (MISTRAL_TEMPLATE, False, False),  # drops it without a word
])
def test_what_a_template_renders_is_found_by_rendering_it(loaded, template, renders_tools,
                                                          takes_system):
    traits = template_traits(TemplateOnly(loaded[1].tokenizer, template), template)
    assert (traits.renders_tools, traits.takes_system) == (renders_tools, takes_system)


def test_earlier_calls_and_results_render_as_the_hermes_template_renders_them(loaded):
    """The generic format is Hermes' (Qwen's): an earlier call and its result render on a
    template without tools as the Hermes template renders them, each as the whole of
    its turn (the call the assistant's, the result a user turn)."""
    tokenizer = loaded[1].tokenizer
    plan, generic = plan_and_prompt(TemplateOnly(tokenizer, QWEN_TEMPLATE), EARLIER,
                                    tools=[WEATHER, TIME])
    assert plan.generic and "tools" not in plan.template_options
    native_plan, native = plan_and_prompt(TemplateOnly(tokenizer, HERMES_TEMPLATE), EARLIER,
                                          tools=[WEATHER, TIME],
                                          chat_template_kwargs={"enable_thinking": False})
    assert not native_plan.generic and "tools" in native_plan.template_options
    answer = native.split("<|im_start|>assistant")[1]
    call = re.search(r"<tool_call>\n.*?\n</tool_call>", answer, re.S).group(0)
    result = re.search(r"<tool_response>\n.*?\n</tool_response>", native, re.S).group(0)
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in generic
    assert f"<|im_start|>user\n{result}<|im_end|>" in generic
    system = generic.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n")
    for tool in (WEATHER, TIME):  # described by name, description and parameters
        assert json.dumps({k: tool["function"][k] for k in ("name", "description", "parameters")
                           if k in tool["function"]}) in system


def test_without_a_system_turn_roles_still_alternate(loaded):
    """Where the template refuses a system turn the tools are described in the first user
    turn; tool results share one user turn with the user's next words."""
    processor = TemplateOnly(loaded[1].tokenizer, ALTERNATING_TEMPLATE)
    calls = [{"id": f"call_{i}", "type": "function", "function": {
        "name": "get_time", "arguments": json.dumps({"zone": zone})}}
        for i, zone in enumerate(["UTC", "CET"])]
    messages = [{"role": "system", "content": "Be brief."}, *ASK,
                {"role": "assistant", "content": "Checking.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_0", "content": "12:00"},
                {"role": "tool", "tool_call_id": "call_1", "content": "13:00"},
                {"role": "user", "content": "And now?"}]
    with pytest.raises(Exception, match="no system role"):  # the template as it is
        render_chat(processor, messages[:2])
    plan, prompt = plan_and_prompt(processor, messages[1:], tools=[TIME],
                                   tool_choice="required")
    assert not plan.takes_system
    first_user = prompt.split("<|im_end|>")[0]
    assert "# Tools" in first_user and first_user.endswith(ASK[0]["content"])
    assert ("<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n"
            "</tool_response>\nAnd now?<|im_end|>") in prompt
    assert ('Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
            '</tool_call>') in prompt


def check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments),
                            PARAMETERS[call.function.name])


@pytest.mark.parametrize("seed", [1, 2])
def test_required_gives_calls_that_validate(client, seed):
    choice = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=120, temperature=1.0, seed=seed).choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_one_call_without_parallel_calls(client):
    for seed in (3, 4):
        choice = client.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_a_budget_past_the_context_still_gives_a_whole_call():
    """max_tokens beyond the room the context leaves after the prompt: the grammar closes
    the call within the room there is. The demo model (a 1024-token context) writes its
    strings on and on, as a model that never learnt tools does."""
    with LiveServer(*mlxvlm.load(DEMO)) as live:
        choice = live.client().chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_tokens=4000, temperature=1.0, seed=9).choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"get_weather"})


def test_a_named_function_with_pydantic_definitions_streams_as_openai_does(client):
    """Parameters as pydantic writes them (``$defs``, ``$ref``) under a named choice."""
    assert "$defs" in PLACE["function"]["parameters"]
    kwargs = dict(model=MODEL_ID, messages=ASK, tools=[TIME, PLACE], max_tokens=200,
                  tool_choice={"type": "function", "function": {"name": "place"}},
                  temperature=1.0, seed=5)
    (call,) = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    check_calls([call], {"place"})
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in streamed] == [
        (0, "place", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("family", ["llava_next", "smolvlm", "paligemma"])
def test_forced_calls_on_other_families(tiny_checkpoints, family):
    """LLaVA-NeXT's Mistral-style template drops a system turn, PaliGemma's refuses one
    (it takes one user turn, with its image), SmolVLM's takes it: each prompt carries
    the description, and the forced call validates."""
    model, processor = mlxvlm.load(tiny_checkpoints.path(family, "hub"))
    asked = [user(ASK[0]["content"], png_data_url(make_image(64, 64)))]
    with LiveServer(model, processor) as live:
        client = live.client()
        plain = client.chat.completions.create(model=MODEL_ID, messages=asked, max_tokens=1)
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=asked, tools=[WEATHER], tool_choice="required",
            max_tokens=150, temperature=1.0, seed=1)
    # The description's tokens, at least one per four characters of the parameters.
    described = len(json.dumps(WEATHER["function"]["parameters"])) // 4
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + described
    assert reply.choices[0].finish_reason == "tool_calls"
    check_calls(reply.choices[0].message.tool_calls, {"get_weather"})


RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in (WEATHER, TIME)]


def test_responses_function_calls_validate_and_their_output_goes_back(client):
    kwargs = dict(model=MODEL_ID, input=ASK[0]["content"], tools=RESPONSES_TOOLS,
                  tool_choice="required", max_output_tokens=120, temperature=1.0)
    response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    events = list(client.responses.create(stream=True, **kwargs))
    assert "response.function_call_arguments.done" in [e.type for e in events]
    streamed = [i for i in events[-1].response.output if i.type == "function_call"]
    for call in streamed:
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    follow = client.responses.create(
        model=MODEL_ID, previous_response_id=response.id, max_output_tokens=4,
        temperature=0, tools=RESPONSES_TOOLS,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21"}
               for c in calls])
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the tools described alike


CLAUDE_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                 "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]


def test_messages_tool_use_blocks_validate_plain_and_streamed(claude):
    kwargs = dict(model=MODEL_ID, max_tokens=120, messages=ASK, tools=CLAUDE_TOOLS,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  extra_body={"temperature": 1.0})
    message = claude.messages.create(**kwargs)
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, PARAMETERS[use.name])
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    for block in final.content:
        assert block.type == "tool_use"
        jsonschema.validate(block.input, PARAMETERS[block.name])


def answer_with(monkeypatch, processor, text: str, end: bool = True) -> None:
    """The random model made to answer ``text`` (then the end, or free steps), in place
    of any script before."""
    monkeypatch.undo()
    tokenizer = processor.tokenizer
    script_tokens(monkeypatch, tokenizer.encode(text, add_special_tokens=False)
                  + ([tokenizer.convert_tokens_to_ids("<|im_end|>")] if end else []))


CALL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def test_auto_text_or_a_call_through_all_three_apis(client, claude, loaded, monkeypatch):
    answer_with(monkeypatch, loaded[1], "It is sunny.")
    choice = client.chat.completions.create(model=MODEL_ID, messages=ASK,
                                            tools=[WEATHER, TIME], max_tokens=120).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "It is sunny."
    assert not choice.message.tool_calls

    answer_with(monkeypatch, loaded[1], "Let me see." + CALL_TEXT)
    choice = client.chat.completions.create(model=MODEL_ID, messages=ASK,
                                            tools=[WEATHER, TIME], max_tokens=120).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me see."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time",
                                                                          {"zone": "CET"})
    message = claude.messages.create(model=MODEL_ID, max_tokens=120, messages=ASK,
                                     tools=CLAUDE_TOOLS)
    assert message.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "text", None) or b.input) for b in message.content] == [
        ("text", "Let me see."), ("tool_use", {"zone": "CET"})]
    response = client.responses.create(model=MODEL_ID, input=ASK[0]["content"],
                                       tools=RESPONSES_TOOLS, max_output_tokens=120)
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert json.loads(response.output[1].arguments) == {"zone": "CET"}


def test_auto_keeps_a_begun_call_valid(client, loaded, monkeypatch):
    """Once the model writes the marker, the grammar holds its call to the schema: the
    random model, left free inside the call, still gives valid arguments."""
    answer_with(monkeypatch, loaded[1], 'Hm.<tool_call>\n{"name": "get_weather", ', end=False)
    choice = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER],
                                            max_tokens=100, temperature=1.0, seed=7).choices[0]
    assert choice.message.content.startswith("Hm.")
    check_calls(choice.message.tool_calls, {"get_weather"})


def matcher_takes(constraint, tokenizer, text: str) -> bool:
    matcher = llguidance.LLMatcher(constraint.lltokenizer, constraint.grammar, log_level=0)
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_the_auto_grammar(loaded):
    processor = loaded[1]
    tokenizer = processor.tokenizer
    tools = [Tool.model_validate(t) for t in (WEATHER, TIME)]

    def grammar(several, tokens=tokenizer):
        return lark_constraint(tokens, eos_token_ids(processor),
                               text_or_calls_grammar(GENERIC_TOOLS, tools, tokens, several), "t")

    one, many = grammar(False), grammar(True)
    for constraint in (one, many):
        assert matcher_takes(constraint, tokenizer, "Any text {at all}\n<tool_ca")
        assert matcher_takes(constraint, tokenizer, "a" + CALL_TEXT + " done")
        assert not matcher_takes(constraint, tokenizer, '<tool_call>\n{"name": "other"')
        assert not matcher_takes(constraint, tokenizer, '<tool_call>\n{"name": "get_time", '
                                 '"arguments": {"zone": 3')
    assert matcher_takes(many, tokenizer, CALL_TEXT + CALL_TEXT)
    assert not matcher_takes(one, tokenizer, CALL_TEXT + "<tool_call>")


def test_markers_the_tokenizer_made_special(loaded):
    """A tokenizer that holds ``<tool_call>`` as a special token: the answer's text keeps
    it (the detokenizer drops special tokens otherwise) and the grammar names it by id."""
    processor = loaded[1]
    tokenizer = copy.deepcopy(processor.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    ids = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert marker_ids(tokenizer, GENERIC_TOOLS) == set(ids)
    assert marker_ids(processor.tokenizer, GENERIC_TOOLS) == set()  # plain text there
    tools = [Tool.model_validate(TIME)]
    grammar = text_or_calls_grammar(GENERIC_TOOLS, tools, tokenizer, True)
    assert f"<[{ids[0]}]>" in grammar and f"<[{ids[1]}]>" in grammar
    constraint = lark_constraint(tokenizer, eos_token_ids(processor), grammar, "t")
    assert matcher_takes(constraint, tokenizer, "Hi." + CALL_TEXT)
    assert not matcher_takes(constraint, tokenizer, '<tool_call>\n{"name": "get_weather"')


def test_none_describes_nothing(loaded):
    """tool_choice "none": the prompt is the one without tools."""
    processor = loaded[1]
    plan, prompt = plan_and_prompt(processor, ASK, tools=[WEATHER], tool_choice="none")
    assert prompt == plan_and_prompt(processor, ASK)[1] and plan.constraint() is None


def test_definitions_move_with_their_references():
    """``#`` and ``#/$defs/...`` follow the parameters under the root's ``$defs``; data
    that looks like a reference (a const, an enum) and a property named like a keyword
    are left as they are."""
    parameters = {"type": "object", "properties": {
        "const": {"$ref": "#/$defs/P"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        "tag": {"const": {"$ref": "#"}}, "kind": {"enum": [{"$ref": "#/x"}]}},
        "$defs": {"P": {"type": "integer"}}}
    tool = Tool.model_validate({"type": "function", "function": {"name": "f",
                                                                 "parameters": parameters}})
    schema = calls_schema([tool])
    moved = schema["$defs"]["arguments_0"]["properties"]
    assert schema["properties"]["arguments"] == {"$ref": "#/$defs/arguments_0"}
    assert moved["const"] == {"$ref": "#/$defs/arguments_0/$defs/P"}
    assert moved["next"]["anyOf"][0] == {"$ref": "#/$defs/arguments_0"}
    assert moved["tag"] == parameters["properties"]["tag"]
    assert moved["kind"] == parameters["properties"]["kind"]
    valid = {"name": "f", "arguments": {"const": 1, "next": {"const": 2, "next": None}}}
    jsonschema.validate(valid, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "f", "arguments": {"const": "x"}}, schema)


def test_the_server_entry_point(tiny_checkpoints):
    """``python -m mlxvlm.server``: a forced call on a template without tools, and a
    tool_choice the tools do not allow answered 400 in each API's own shape."""
    with ServerProcess("--model", str(tiny_checkpoints.path("qwen2_vl", "hub"))) as server:
        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        choice = server.openai_client().chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
            max_tokens=120, temperature=1.0, seed=8).choices[0]
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, {"get_weather"})

        def post(path, body):
            return httpx.post(server.base_url + path, json={"model": model, **body},
                              timeout=60)

        claude = {"max_tokens": 8, "messages": ASK, "tools": CLAUDE_TOOLS}
        for body, named in (({**claude, "tool_choice": {"type": "tool", "name": "nope"}},
                             "'nope'"),
                            ({"max_tokens": 8, "messages": ASK,
                              "tool_choice": {"type": "any"}}, "'any' needs tools")):
            reply = post("/v1/messages", body)
            assert reply.status_code == 400, reply.text
            error = reply.json()
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
            assert named in error["error"]["message"]
        for body, named in (({"input": "hi", "tools": RESPONSES_TOOLS,
                              "tool_choice": {"type": "function", "name": "nope"}}, "'nope'"),
                            ({"input": "hi", "tool_choice": "required"},
                             "'required' needs tools")):
            reply = post("/v1/responses", body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == "tool_choice"
            assert named in error["message"]
