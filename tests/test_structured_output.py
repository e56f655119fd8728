"""Structured output by constrained decoding (mlxvlm/sampling/constrained.py, llguidance): on a
random tiny model, every answer parses and validates against its schema -- through
``generate`` (greedy and sampled, token budgets short and long), chat completions'
``response_format`` (plain, streamed, several requests batched together), the Responses
API's ``text.format`` -- and a schema that cannot be used is a 400, not ignored."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from server_harness import MODEL_ID, LiveServer

import mlxvlm
from mlxvlm.errors import MlxvlmError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "pets": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "pets", "kind", "address"],
    "additionalProperties": False,
}
SCHEMAS = {
    "person": PERSON,
    "list-of-numbers": {"type": "object", "properties": {
        "values": {"type": "array", "items": {"type": "number"}, "minItems": 1}},
        "required": ["values"], "additionalProperties": False},
    "flag": {"type": "object", "properties": {"ok": {"type": "boolean"}},
             "required": ["ok"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("max_tokens", [72, 120, 300])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_validates(loaded, name, max_tokens, temperature):
    model, processor = loaded
    out = mlxvlm.generate(model, processor, "Describe a person as JSON.",
                          max_tokens=max_tokens, temperature=temperature, seed=3,
                          json_schema=SCHEMAS[name])
    jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    assert len(out.tokens) <= max_tokens


def test_a_budget_too_small_for_the_schema_is_refused_before_generating(loaded):
    model, processor = loaded
    with pytest.raises(MlxvlmError, match="too few"):
        mlxvlm.generate(model, processor, "A person.", max_tokens=20, json_schema=PERSON)


def test_without_the_schema_the_random_model_writes_no_json(loaded):
    # What the constraint changes: unconstrained, this model's answer does not parse.
    model, processor = loaded
    out = mlxvlm.generate(model, processor, "Describe a person as JSON.", max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_any_json_object(loaded):
    model, processor = loaded
    out = mlxvlm.generate(model, processor, "JSON please.", max_tokens=48, temperature=1.0,
                          seed=5, json_schema=True)
    assert isinstance(json.loads(out.text), dict)


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(*loaded, max_concurrency=4) as live:
        yield live


def person_format(strict=True):
    return {"type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def test_chat_completions_response_format(server):
    client = server.client()
    for stream in (False, True):
        kwargs = dict(model=MODEL_ID, max_tokens=120, temperature=1.0, seed=11,
                      messages=[{"role": "user", "content": "A person, as JSON."}],
                      response_format=person_format())
        if stream:
            text = "".join(chunk.choices[0].delta.content or ""
                           for chunk in client.chat.completions.create(stream=True, **kwargs)
                           if chunk.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
    json_object = client.chat.completions.create(
        model=MODEL_ID, max_tokens=60, messages=[{"role": "user", "content": "JSON."}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(json_object.choices[0].message.content), dict)


def test_constrained_requests_batched_together_each_validate(server):
    client = server.client()

    def ask(seed):
        return client.chat.completions.create(
            model=MODEL_ID, max_tokens=80, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": f"Person number {seed}."}],
            response_format=person_format() if seed % 2 else None,
        ).choices[0].message.content

    before = server.engine.stats.peak_batch_size
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    for seed, text in enumerate(answers):
        if seed % 2:
            jsonschema.validate(json.loads(text), PERSON)
    assert server.engine.stats.peak_batch_size >= max(before, 2)


def test_responses_text_format(server):
    response = server.client().responses.create(
        model=MODEL_ID, input="A person, as JSON.", max_output_tokens=120,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


def test_a_schema_that_cannot_be_used_is_a_400(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL_ID, max_tokens=8, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "no-such-type"}}})
    assert raised.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL_ID, max_tokens=8, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema"})
