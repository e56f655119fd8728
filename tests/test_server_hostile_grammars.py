"""Grammars one client sends must not hurt the others' answers, nor come back unparsable,
through ``python -m mlxvlm.server`` as users start it (issue 39, items 2 and 10): each
hostile request is sent together with bystanders (greedy, some of them constrained
themselves), whose answers must be exactly what the same requests get alone; the
refusals are 400s in OpenAI's shape, counted on ``/metrics``, and logged in one bounded
line. On the tiny checkpoint whose template thinks (test_server_tools's)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from server_process import ServerProcess
from test_server_tools import WEATHER, checkpoint  # noqa: F401  (the fixture)
from transformers import AutoTokenizer

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# 5,000 alternatives at once: more than llguidance's parser holds in one row (2,000).
WIDE = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                   "required": [f"k{i}"], "additionalProperties": False}
                  for i in range(5000)]}
# The same alternatives behind an optional property: the grammar compiles and its
# shortest answer ({}) never meets them; an answer that opens "b" does, mid-way.
WIDE_INSIDE = {"type": "object", "properties": {"b": WIDE}, "additionalProperties": False}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}
def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


BYSTANDERS = [
    {"messages": [{"role": "user", "content": f"Tell me about {topic}."}],
     "temperature": 0, "max_tokens": 24}
    for topic in ("cats", "the sea", "trains", "bread")
] + [
    {"messages": [{"role": "user", "content": "Is it fine? Answer in JSON."}],
     "temperature": 0, "max_tokens": 40, **NO_THINKING,
     "response_format": json_format(FLAG)},
    {"messages": [{"role": "user", "content": "Plain words, please."}], "temperature": 0,
     "max_tokens": 24, **NO_THINKING},
]


@pytest.fixture(scope="module")
def server(checkpoint):  # noqa: F811
    with ServerProcess("--model", str(checkpoint), "--served-model-name", "tiny",
                       "--max-concurrency", "8", "--prompt-cache-size", "0") as live:
        yield live


@pytest.fixture(scope="module")
def tokenizer(checkpoint):  # noqa: F811
    return AutoTokenizer.from_pretrained(checkpoint)


def ask(server, body: dict) -> tuple[int, dict]:
    response = httpx.post(f"{server.base_url}/v1/chat/completions",
                          json={"model": "tiny", **body}, timeout=180)
    return response.status_code, response.json()


def stream(server, body: dict) -> list[dict]:
    """A streamed answer's events (their data, [DONE] left out)."""
    events = []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=180,
                      json={"model": "tiny", "stream": True, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def answer_of(reply: tuple[int, dict]) -> tuple:
    status, body = reply
    assert status == 200, body
    message = body["choices"][0]["message"]
    return message["content"], message.get("reasoning_content")


def metric(server, sample: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def alone(server):
    """Each bystander's answer when it is the only request."""
    return [answer_of(ask(server, body)) for body in BYSTANDERS]


def with_bystanders(server, hostile) -> tuple[object, list[tuple]]:
    """``hostile(server)`` run while the bystanders are asked, all at once."""
    with ThreadPoolExecutor(len(BYSTANDERS) + 1) as pool:
        others = [pool.submit(ask, server, body) for body in BYSTANDERS]
        outcome = pool.submit(hostile, server)
        return outcome.result(), [answer_of(o.result()) for o in others]


def refused(reply: tuple[int, dict], param: str) -> str:
    status, body = reply
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    return error["message"]


def test_a_grammar_too_wide_for_the_parser_is_refused_before_it_runs(server, alone):
    before = metric(server, 'mlxvlm_requests_refused_total{reason="grammar"}')
    log_before = len(server.log())
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 24, **NO_THINKING,
            "response_format": json_format(WIDE)}
    reply, others = with_bystanders(server, lambda s: ask(s, body))
    message = refused(reply, "response_format")
    assert "max is 2000" in message and len(message) < 400
    assert others == alone
    assert metric(server, 'mlxvlm_requests_refused_total{reason="grammar"}') == before + 1
    # The grammar (548 KB) is in neither the answer nor the log.
    assert len(server.log()) - log_before < 4000


def test_a_grammar_failing_mid_answer_ends_that_answer_alone(server, alone, tokenizer):
    # The bias walks the answer into "b", where the parser gives up at the inner "{".
    (brace,), (quote,), (b,) = (tokenizer.encode(t, add_special_tokens=False)
                                for t in ("{", '"', "b"))
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 64,
            "temperature": 0, **NO_THINKING, "logit_bias": {brace: 100, quote: 100, b: 100},
            "response_format": json_format(WIDE_INSIDE)}
    failed_before = metric(server, "mlxvlm_sequences_failed_total")
    log_before = len(server.log())
    reply, others = with_bystanders(server, lambda s: ask(s, body))
    assert "max is 2000" in refused(reply, "response_format")
    assert others == alone
    events, others = with_bystanders(server, lambda s: stream(s, body))
    assert others == alone
    # Streamed: the tokens before the failure, then an error event in OpenAI's shape.
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text and '{"b":{'.startswith(text)
    assert events[-1]["error"]["type"] == "invalid_request_error"
    assert "max is 2000" in events[-1]["error"]["message"]
    assert metric(server, "mlxvlm_sequences_failed_total") == failed_before + 2
    assert len(server.log()) - log_before < 8000


def test_a_thinking_budget_with_a_forced_call_ends_the_thoughts_through_the_grammar(
        server, alone):
    # The forced call comes after the thoughts the prompt opened; the budget's end tag is
    # what the grammar expects there.
    body = {"messages": [{"role": "user", "content": "The weather in Paris?"}],
            "tools": [WEATHER], "tool_choice": "required", "thinking_budget": 2,
            "max_tokens": 200, "temperature": 0}
    reply, others = with_bystanders(server, lambda s: ask(s, body))
    assert others == alone
    status, answer = reply
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    # The thoughts are the model's own first two tokens, as it thinks unconstrained (the
    # same prompt, its tools in the system turn, with no call forced).
    free = {key: body[key] for key in ("messages", "tools", "temperature")}
    _, reasoning = answer_of(ask(server, {**free, "max_tokens": 2}))
    assert choice["message"]["reasoning_content"] == reasoning
    # Without a budget this model never ends its thoughts: they are ended in time for
    # the whole call to follow within max_tokens.
    status, answer = ask(server, {**body, "thinking_budget": None})
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    (call,) = message["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    assert len(message["reasoning_content"]) > len(reasoning)
    assert answer["usage"]["completion_tokens"] <= body["max_tokens"]


def test_a_pattern_string_closes_in_time(server, tokenizer):
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    schema = {"type": "string", "pattern": "^a+$"}
    for seed in range(3):
        status, body = ask(server, {
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 8, "seed": seed,
            "temperature": 1.0, "logit_bias": {a: 20}, **NO_THINKING,  # it wants more "a"
            "response_format": json_format(schema)})
        assert status == 200, body
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)


def test_items_that_cannot_fit_are_refused_and_what_fits_closes(server):
    def ask_for(min_items: int, max_tokens: int, seed: int = 0):
        schema = {"type": "array", "items": {"type": "integer"}, "minItems": min_items}
        return schema, ask(server, {
            "messages": [{"role": "user", "content": "Numbers."}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed, **NO_THINKING,
            "response_format": json_format(schema)})

    before = metric(server, 'mlxvlm_requests_refused_total{reason="max_tokens"}')
    _, reply = ask_for(5000, 16)
    assert "too few" in refused(reply, "max_tokens")
    assert metric(server, 'mlxvlm_requests_refused_total{reason="max_tokens"}') == before + 1
    for seed in range(3):
        schema, (status, body) = ask_for(8, 24, seed)
        assert status == 200, body
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
