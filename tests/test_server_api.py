"""The OpenAI-compatible server, driven by the official ``openai`` client: plain and
streaming completions, images as data URLs, multi-turn conversations (with prefix reuse),
stop strings, seeds, log-probabilities, and the exact shape of responses and chunks."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_harness import MODEL_ID, LiveServer, png_data_url, user
from tiny import make_image

import mlxvlm

GREEDY = {"temperature": 0, "max_tokens": 24}


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


def reference(loaded, messages, **kwargs):
    model, processor = loaded
    return mlxvlm.generate(model, processor, messages, **kwargs)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL_ID, messages=messages, **kwargs)


def test_plain_completion_matches_generate_and_has_openai_shape(client, loaded):
    messages = [{"role": "user", "content": "Describe a garden with a house."}]
    response = chat(client, messages, **GREEDY)
    expected = reference(loaded, messages, max_tokens=24)

    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert response.model == MODEL_ID
    (choice,) = response.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert choice.logprobs is None
    assert response.usage.prompt_tokens == expected.prompt_tokens
    assert response.usage.completion_tokens == len(expected.tokens)
    assert response.usage.total_tokens == expected.prompt_tokens + len(expected.tokens)


def test_streaming_with_usage(client):
    messages = [{"role": "user", "content": "What is in the picture?"}]
    whole = chat(client, messages, **GREEDY)
    chunks = list(chat(client, messages, stream=True,
                       stream_options={"include_usage": True}, **GREEDY))

    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    with_choices = [c for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in with_choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == whole.choices[0].message.content
    # The usage chunk comes last, alone, and only because it was asked for.
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    # The second request reused the first one's cache for all of the shared prompt but
    # its last token, which is computed again to give the first new token's logits.
    assert usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_wire_format_without_usage(server):
    body = {"model": MODEL_ID, "stream": True,
            "messages": [{"role": "user", "content": "Hello"}], **GREEDY}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in chunk for chunk in chunks)


def test_image_as_data_url_matches_generate(client, loaded):
    image = make_image(64, 48, seed=11)
    messages = [user("Describe this image.", png_data_url(image))]
    response = chat(client, messages, **GREEDY)
    expected = reference(loaded, [{"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "text", "text": "Describe this image."}]}],
        max_tokens=24)
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == expected.prompt_tokens
    other = chat(client, [user("Describe this image.", png_data_url(make_image(64, 48, seed=12)))],
                 **GREEDY)
    assert other.choices[0].message.content != expected.text  # the image is really used


@pytest.fixture
def vision_calls(loaded, monkeypatch):
    """How many times the vision tower runs (the engine calls it from its own thread)."""
    model, _ = loaded
    tower = type(model.vision_tower)
    calls = []
    original = tower.encode  # what __call__ runs, and what the model calls

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(tower, "encode", counting)
    return calls


def test_multi_turn_with_images_reuses_the_prefix(client, loaded, vision_calls):
    first_image = png_data_url(make_image(56, 56, seed=21))
    turn1 = [user("Describe this image.", first_image)]
    answer1 = chat(client, turn1, **GREEDY)
    assert len(vision_calls) == 1

    turn2 = turn1 + [
        {"role": "assistant", "content": answer1.choices[0].message.content},
        {"role": "user", "content": "What colours are in it?"},
    ]
    answer2 = chat(client, turn2, **GREEDY)
    # Neither the image nor the shared prefix is computed again...
    assert len(vision_calls) == 1
    cached = answer2.usage.prompt_tokens_details.cached_tokens
    assert cached >= answer1.usage.prompt_tokens
    assert cached < answer2.usage.prompt_tokens
    # ...and the answer is the one a fresh run over the whole conversation gives.
    model, processor = loaded
    image = make_image(56, 56, seed=21)
    fresh = [{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": "Describe this image."}]},
             *turn2[1:]]
    assert answer2.choices[0].message.content == reference(loaded, fresh, max_tokens=24).text

    # A new image in a later turn is encoded; the conversation before it is still reused.
    turn3 = turn2 + [
        {"role": "assistant", "content": answer2.choices[0].message.content},
        user("And this one?", png_data_url(make_image(48, 64, seed=22))),
    ]
    before = len(vision_calls)  # (the fresh reference run above encoded the image too)
    answer3 = chat(client, turn3, **GREEDY)
    assert len(vision_calls) == before + 1
    assert answer3.usage.prompt_tokens_details.cached_tokens >= answer2.usage.prompt_tokens


def test_stop_strings(client):
    messages = [{"role": "user", "content": "Tell me about the lazy dog."}]
    text = chat(client, messages, **GREEDY).choices[0].message.content
    stop = text[6:9]
    cut = text.find(stop)
    assert cut > 0
    stopped = chat(client, messages, stop=[stop, "never-appears"], **GREEDY)
    assert stopped.choices[0].message.content == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = chat(client, messages, stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[:cut]


def test_seed_reproducibility(client):
    messages = [{"role": "user", "content": "Describe the river bank."}]
    sample = {"temperature": 1.0, "max_tokens": 16}
    texts = {seed: chat(client, messages, seed=seed, **sample).choices[0].message.content
             for seed in (7, 8, 9)}
    assert chat(client, messages, seed=7, **sample).choices[0].message.content == texts[7]
    assert len(set(texts.values())) > 1


def test_logprobs(client):
    messages = [{"role": "user", "content": "Compare the two images."}]
    response = chat(client, messages, logprobs=True, top_logprobs=3, **GREEDY)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        # Greedy picks the most likely token.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    if response.choices[0].finish_reason == "length":  # every token is text
        joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
        assert joined.strip() == response.choices[0].message.content.strip()

    chunks = list(chat(client, messages, logprobs=True, stream=True, **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)


def test_max_completion_tokens_wins_over_max_tokens(client):
    response = chat(client, [{"role": "user", "content": "Hello"}], temperature=0,
                    max_tokens=20, max_completion_tokens=5)
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"


def test_unknown_fields_are_ignored_with_a_warning(client, caplog):
    caplog.set_level("WARNING", logger="mlxvlm.server")
    response = chat(client, [{"role": "user", "content": "Hello"}],
                    extra_body={"frobnicate": True, "reasoning_mode": "deep"}, **GREEDY)
    assert response.choices[0].message.content
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("frobnicate" in w and "reasoning_mode" in w for w in warnings)


def test_n_above_one_is_refused(client):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, [{"role": "user", "content": "Hello"}], n=2, **GREEDY)
    assert error.value.body["param"] == "n"


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server.base_url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = metrics.text
    for name in ("mlxvlm_requests_total{status=\"200\"}", "mlxvlm_queue_depth",
                 "mlxvlm_active_sequences", "mlxvlm_decode_tokens_per_second",
                 "mlxvlm_time_to_first_token_seconds_count", "mlxvlm_generation_tokens_total"):
        assert name in text
    assert "# TYPE mlxvlm_time_to_first_token_seconds summary" in text


def test_failure_after_streaming_started_is_an_error_event(server, client, monkeypatch):
    def broken_decode_step():
        raise RuntimeError("simulated fault in the decode step")

    monkeypatch.setattr(server.engine, "_decode_step", broken_decode_step)
    stream = chat(client, [{"role": "user", "content": "Hello"}], stream=True, **GREEDY)
    received = []
    with pytest.raises(openai.APIError, match="generation failed"):
        for chunk in stream:
            received.append(chunk)
    assert received and received[0].choices[0].delta.role == "assistant"
    monkeypatch.undo()
    assert chat(client, [{"role": "user", "content": "Hello"}], **GREEDY).choices


def test_penalties_and_logit_bias_answer_as_generate_does(client, loaded):
    # Their logits processors read the prompt's ids, made in the request's thread and
    # used in the engine's (a regression: that failed with a 500).
    messages = [{"role": "user", "content": "Describe a garden with a house."}]
    response = chat(client, messages, presence_penalty=1.5, frequency_penalty=0.5,
                    logit_bias={"7": 5.0}, **GREEDY)
    expected = reference(loaded, messages, max_tokens=24, presence_penalty=1.5,
                         frequency_penalty=0.5, logit_bias={7: 5.0})
    assert response.choices[0].message.content == expected.text
    plain = reference(loaded, messages, max_tokens=24)
    assert expected.text != plain.text  # the options change the answer
    repeated = client.chat.completions.create(
        model=MODEL_ID, messages=messages, extra_body={"repetition_penalty": 1.3}, **GREEDY)
    assert repeated.choices[0].message.content == reference(
        loaded, messages, max_tokens=24, repetition_penalty=1.3).text
