"""OpenAI's Responses API (``POST /v1/responses``), driven by the official ``openai``
client: the same greedy answer as chat completions for the same conversation (input as a
string and as items with images, instructions), the official event sequence when
streaming, ``max_output_tokens`` as an incomplete response, and conversations continued
by ``previous_response_id`` from a bounded store that reuses the prefix cache and is
kept apart per API key."""

from __future__ import annotations

import openai
import pytest
from server_harness import MODEL_ID, LiveServer, png_data_url
from tiny import make_image

import mlxvlm

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(*loaded, api_keys=["key-one", "key-two"], max_stored_responses=3) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key="key-one")


def create(client, **kwargs):
    kwargs.setdefault("max_output_tokens", MAX_TOKENS)
    return client.responses.create(model=MODEL_ID, temperature=0, **kwargs)


def chat_answer(client, messages, max_tokens=MAX_TOKENS):
    response = client.chat.completions.create(model=MODEL_ID, messages=messages,
                                              temperature=0, max_tokens=max_tokens)
    return response.choices[0].message.content, response.choices[0].finish_reason


def test_a_string_input_gives_the_chat_completions_answer(client, loaded):
    response = create(client, input="Describe a garden.", instructions="Be terse.")
    text, finish = chat_answer(client, [{"role": "system", "content": "Be terse."},
                                        {"role": "user", "content": "Describe a garden."}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL_ID
    assert response.output_text == text
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    assert [part.type for part in item.content] == ["output_text"]
    if finish == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
    model, processor = loaded
    expected = mlxvlm.generate(model, processor, [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Describe a garden."}], max_tokens=MAX_TOKENS)
    assert response.usage.input_tokens == expected.prompt_tokens
    assert response.usage.output_tokens == len(expected.tokens)
    assert response.usage.total_tokens == expected.prompt_tokens + len(expected.tokens)


def test_items_with_an_image_give_the_chat_completions_answer(client):
    url = png_data_url(make_image(64, 48, seed=4))
    response = create(client, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": url},
        {"type": "input_text", "text": "What is in the picture?"}]}])
    text, _ = chat_answer(client, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is in the picture?"}]}])
    assert response.output_text == text
    other = create(client, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": png_data_url(make_image(64, 48, seed=9))},
        {"type": "input_text", "text": "What is in the picture?"}]}])
    assert other.output_text != text


def test_the_stream_follows_the_official_event_sequence(client):
    whole = create(client, input="Describe a house.")
    events = list(create(client, input="Describe a house.", stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.status == whole.status


def test_a_low_max_output_tokens_is_an_incomplete_response(client):
    response = create(client, input="Describe a garden.", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(client):
    first = create(client, input="Name a colour.")
    second = create(client, input="And another?", previous_response_id=first.id)
    text, _ = chat_answer(client, [{"role": "user", "content": "Name a colour."},
                                   {"role": "assistant", "content": first.output_text},
                                   {"role": "user", "content": "And another?"}])
    assert second.output_text == text
    assert second.previous_response_id == first.id
    # The first turn was not prefilled again.
    assert second.usage.input_tokens_details.cached_tokens > 0
    # Continued again, from the second.
    third = create(client, input="One more.", previous_response_id=second.id)
    assert third.usage.input_tokens > second.usage.input_tokens


def test_stored_responses_are_bounded_and_kept_per_api_key(server, client):
    mine = create(client, input="Name a colour.")
    with pytest.raises(openai.BadRequestError) as raised:
        create(server.client(api_key="key-two"), input="And another?",
               previous_response_id=mine.id)
    assert raised.value.body["param"] == "previous_response_id"
    unstored = create(client, input="Name a colour.", store=False)
    with pytest.raises(openai.BadRequestError):
        create(client, input="And another?", previous_response_id=unstored.id)
    # At most 3 kept: the oldest goes first.
    for _ in range(3):
        create(client, input="Name a shape.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        create(client, input="And another?", previous_response_id=mine.id)
    assert len(server.app.state.response_store) == 3

