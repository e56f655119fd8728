"""Tools and thinking in chat completions, with the official ``openai`` client, on a tiny
checkpoint whose chat template is Hermes/Qwen-style (tools in the system turn,
``<tool_call>`` JSON, ``<think>`` opened by the generation prompt unless
``enable_thinking`` is false): tools reach the template; "required" and a named
function always give calls whose arguments validate against the parameters (streamed as
OpenAI streams them, ``finish_reason`` "tool_calls"), pydantic's ``$defs`` included; an
earlier call and its result go back through the template; thinking comes back apart as ``reasoning_content``. The
splitting itself (``answer_parts``) is checked on written answers in both families'
formats."""

from __future__ import annotations

import json
import shutil

import anthropic
import jsonschema
import pytest
from pydantic import BaseModel
from server_harness import MODEL_ID, LiveServer

import mlxvlm
from mlxvlm.text.answer_parts import HERMES, MISTRAL, AnswerSplitter

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Call a function as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{%- else %}"
    "{%- for part in message.content %}{%- if part.type == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{%- elif part.type == 'text' %}{{ part.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is not defined or enable_thinking %}<think>\n{%- endif %}{%- endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tools") / "qwen2_vl-tools"
    shutil.copytree(tiny_checkpoints.path("qwen2_vl", "hub"), directory)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return mlxvlm.load(checkpoint)


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


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments),
                            PARAMETERS[call.function.name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gives_calls_that_validate(client, seed):
    response = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=160, temperature=1.0, seed=seed,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_a_named_function_is_the_one_called_and_streams_as_openai_does(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=MODEL_ID, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                  max_tokens=120, temperature=1.0, seed=4,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time"
    check_calls([call], {"get_time"})
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in streamed] == [0]
    assert streamed[0].function.name == "get_time"
    assert streamed[0].function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tools_and_earlier_calls_reach_the_template(loaded):
    model, processor = loaded
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    from mlxvlm.server.chat_completions import to_messages
    from mlxvlm.server.schemas import ChatCompletionRequest
    from mlxvlm.server.tools import AnswerPlan

    chat = ChatCompletionRequest.model_validate(
        {"model": MODEL_ID, "messages": messages, "tools": [WEATHER]})
    plan = AnswerPlan(chat, processor)
    text = mlxvlm.prompt.render_chat(processor, to_messages(chat), plan.template_options)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\nsunny, 21\n</tool_response>" in text


def test_thinking_comes_back_apart_and_can_be_turned_off(client, loaded):
    thinking = client.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=16,
                                              temperature=0)
    message = thinking.choices[0].message
    # The generation prompt opened <think> and this random model never closes it.
    model, processor = loaded
    expected = mlxvlm.generate(model, processor, ASK, max_tokens=16)
    assert message.model_extra["reasoning_content"] == expected.text
    assert not message.content
    plain = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, max_tokens=16, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert plain.content and "reasoning_content" not in (plain.model_extra or {})


class Box(BaseModel):
    side: int
    colour: str


class Shelf(BaseModel):
    top: Box
    more: list[Box]


def test_parameters_with_pydantic_definitions(client):
    """Parameters as pydantic writes them (``$defs``, ``$ref``) under "required" and a
    named function, in the template's own format."""
    place = {"type": "function", "function": {"name": "place",
                                              "parameters": Shelf.model_json_schema()}}
    assert "$defs" in place["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "place"}}):
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=[TIME, place], tool_choice=choice,
            max_tokens=200, temperature=1.0, seed=5,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
        for call in reply.message.tool_calls:
            schema = place["function"] if call.function.name == "place" else TIME["function"]
            jsonschema.validate(json.loads(call.function.arguments), schema["parameters"])


def split(fmt, pieces, thinking=True):
    splitter = AnswerSplitter(fmt, thinking)
    parts = [p for piece in pieces for p in splitter.feed(piece)] + splitter.finish()
    text = {k: "".join(p.text for p in parts if p.kind == k) for k in ("content", "reasoning")}
    return text, splitter.calls


def test_split_hermes_answers_in_any_chunking():
    answer = ('<think>the user wants weather</think>\nLet me check.<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
              '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}'
              '\n</tool_call>')
    for size in (1, 3, 7, len(answer)):
        text, calls = split(HERMES, [answer[i:i + size] for i in range(0, len(answer), size)])
        assert text == {"content": "Let me check.", "reasoning": "the user wants weather"}
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]


def test_split_mistral_answers_both_forms():
    text, calls = split(MISTRAL, ['Sure. [TOOL_CALLS][{"name": "get_time", ',
                                  '"arguments": {"zone": "UTC"}}]'], thinking=False)
    assert text["content"] == "Sure. " and [c.name for c in calls] == ["get_time"]
    text, calls = split(MISTRAL, ['[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'], thinking=False)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]


def test_a_region_that_is_not_a_call_stays_text():
    text, calls = split(HERMES, ["a <tool_call>not json</tool_call> b"])
    assert calls == [] and text["content"] == "a <tool_call>not json</tool_call> b"
    text, calls = split(HERMES, ["almost <tool_ca"])  # held back, then given at the end
    assert text["content"] == "almost <tool_ca"


CLAUDE_WEATHER = {"name": "get_weather", "description": "The weather in a city",
                  "input_schema": WEATHER["function"]["parameters"]}
NO_THINKING = {"thinking": {"type": "disabled"}, "temperature": 1.0}


def test_messages_tool_use_blocks_validate_plain_and_streamed(claude):
    kwargs = dict(model=MODEL_ID, max_tokens=120, messages=ASK, tools=[CLAUDE_WEATHER],
                  tool_choice={"type": "any"},
                  # Greedy: Anthropic's API has no seed, and the streamed answer must be
                  # the plain one.
                  extra_body=dict(NO_THINKING, temperature=0))
    message = claude.messages.create(**kwargs)
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    for use in uses:
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, PARAMETERS["get_weather"])
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [u.input for u in uses]
    assert final.stop_reason == "tool_use"


def test_messages_tool_results_go_back_through_the_template(loaded):
    from mlxvlm.server.chat_completions import to_messages
    from mlxvlm.server.anthropic_messages import to_chat_request
    from mlxvlm.server.anthropic_schemas import MessagesRequest
    from mlxvlm.server.tools import AnswerPlan

    request = MessagesRequest.model_validate({
        "model": MODEL_ID, "max_tokens": 8, "tools": [CLAUDE_WEATHER], "messages": ASK + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
             "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "sunny, 21"}]}]})
    chat = to_chat_request(request)
    model, processor = loaded
    text = mlxvlm.prompt.render_chat(processor, to_messages(chat),
                                     AnswerPlan(chat, processor).template_options)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\nsunny, 21\n</tool_response>" in text


def test_messages_thinking_blocks(claude, loaded):
    model, processor = loaded
    expected = mlxvlm.generate(model, processor, ASK, max_tokens=16)
    thinking = claude.messages.create(model=MODEL_ID, max_tokens=16, messages=ASK,
                                      extra_body={"temperature": 0})
    assert [b.type for b in thinking.content] == ["thinking"]
    assert thinking.content[0].thinking == expected.text
    plain = claude.messages.create(model=MODEL_ID, max_tokens=16, messages=ASK,
                                   extra_body={"thinking": {"type": "disabled"},
                                               "temperature": 0})
    assert [b.type for b in plain.content] == ["text"]


RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_function_calls_validate_and_continue_with_their_output(client):
    kwargs = dict(model=MODEL_ID, input="What is the weather in Paris?",
                  tools=[RESPONSES_WEATHER], tool_choice="required", max_output_tokens=120,
                  temperature=1.0, reasoning={"effort": "none"})
    response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), PARAMETERS["get_weather"])
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds
    streamed = [i for i in events[-1].response.output if i.type == "function_call"]
    assert streamed and all(json.loads(c.arguments) for c in streamed)
    follow = client.responses.create(
        model=MODEL_ID, previous_response_id=response.id, max_output_tokens=8,
        temperature=0, reasoning={"effort": "none"},
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny, 21"}])
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_responses_reasoning_item(client, loaded):
    model, processor = loaded
    expected = mlxvlm.generate(model, processor, ASK, max_tokens=16)
    response = client.responses.create(model=MODEL_ID, input=ASK[0]["content"],
                                       max_output_tokens=16, temperature=0)
    (item,) = response.output
    assert item.type == "reasoning"
    assert item.content[0].text == expected.text
