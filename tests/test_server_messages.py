"""Anthropic's Messages API (``POST /v1/messages``), driven by the official ``anthropic``
client: the same greedy answer as chat completions and ``mlxvlm.generate`` for the same
conversation (system prompt, images as base64 and data URLs, several turns), stop
sequences and stop reasons, the event stream, usage, Anthropic's error shape and its
``x-api-key`` authentication."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
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
    with LiveServer(*loaded, api_keys=["key-one"]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="key-one", max_retries=0,
                               timeout=60.0)


def png_base64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def reference(loaded, messages, **kwargs):
    model, processor = loaded
    return mlxvlm.generate(model, processor, messages, max_tokens=MAX_TOKENS, **kwargs)


# Today's Anthropic API has no sampling fields (the client no longer takes them); older
# clients send temperature, top_p and top_k, which the server takes: greedy here.
GREEDY = {"extra_body": {"temperature": 0}}


def create(client, messages, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.messages.create(model=MODEL_ID, messages=messages, **GREEDY, **kwargs)


def test_a_text_answer_equals_generate_and_has_anthropics_shape(client, loaded):
    message = create(client, [{"role": "user", "content": "Describe a garden."}],
                     system="You are terse.")
    expected = reference(loaded, [{"role": "system", "content": "You are terse."},
                                  {"role": "user", "content": "Describe a garden."}])
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL_ID
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.text
    assert message.stop_reason == ("max_tokens" if expected.finish_reason == "length"
                                   else "end_turn")
    assert message.stop_sequence is None
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) \
        == expected.prompt_tokens
    assert message.usage.output_tokens == len(expected.tokens)


def test_an_image_block_in_base64_and_as_a_url_give_the_chat_completions_answer(
        client, server, loaded):
    image = make_image(64, 48, seed=4)
    question = "What is in the picture?"
    chat = server.client().chat.completions.create(
        model=MODEL_ID, temperature=0, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(image)}},
            {"type": "text", "text": question}]}])
    for source in ({"type": "base64", "media_type": "image/png", "data": png_base64(image)},
                   {"type": "url", "url": png_data_url(image)}):
        message = create(client, [{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": question}]}])
        assert message.content[0].text == chat.choices[0].message.content
    # The picture is seen: another one gives another answer.
    other = create(client, [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": png_base64(make_image(64, 48, seed=9))}},
        {"type": "text", "text": question}]}])
    assert other.content[0].text != chat.choices[0].message.content


def test_several_turns(client, loaded):
    turns = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "Blue."},
             {"role": "user", "content": [{"type": "text", "text": "And another?"}]}]
    message = create(client, turns)
    expected = reference(loaded, [turns[0], turns[1],
                                  {"role": "user", "content": "And another?"}])
    assert message.content[0].text == expected.text


def test_a_stop_sequence_is_named_in_the_answer(client, loaded):
    messages = [{"role": "user", "content": "Describe a garden."}]
    full = reference(loaded, messages).text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert len(stop) == 2 and stop.strip()
    message = create(client, messages, stop_sequences=["zzzz-never", stop])
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert message.content[0].text == full[: full.index(stop)]


def test_the_event_stream_has_anthropics_events_and_the_same_text(client):
    messages = [{"role": "user", "content": "Describe a house."}]
    whole = create(client, messages)
    with client.messages.stream(model=MODEL_ID, max_tokens=MAX_TOKENS, messages=messages,
                                **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert "message_delta" in kinds
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_errors_have_anthropics_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(client, [{"role": "user", "content": "hi"}], max_tokens=0)
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in raised.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="another-model", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["error"]["type"] == "not_found_error"
    # A block type the server does not take is refused, not ignored.
    with pytest.raises(anthropic.BadRequestError):
        create(client, [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "x"}}]}])


def test_x_api_key_is_checked(server):
    body = {"model": MODEL_ID, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as raised:
        wrong.messages.create(**body)
    assert raised.value.body["error"]["type"] == "authentication_error"
    missing = httpx.post(f"{server.base_url}/v1/messages", json=body)
    assert missing.status_code == 401
    assert missing.json()["type"] == "error"
    # OpenAI's clients still authenticate with the bearer form on the same server.
    bearer = httpx.post(f"{server.base_url}/v1/messages", json=body,
                        headers={"Authorization": "Bearer key-one"})
    assert bearer.status_code == 200
