"""/v1/embeddings and /v1/rerank through ``python -m mlxvlm.server`` (a subprocess, the
session's ``retrieval_server`` of tests/retrieval_fixtures.py, which the Qwen3-VL
retrieval tests share): the official ``openai`` client's ``embeddings.create`` (float
and base64) and plain HTTP for rerank, against transformers' ColQwen2ForRetrieval on the
same tiny checkpoint; what /v1/models says each model does; chat and retrieval requests
to the wrong kind of model refused with 400s; the chat routes' keys, body limit and
media rules."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from retrieval_fixtures import RETRIEVAL_KEY as KEY
from retrieval_fixtures import SERVED_CAPABILITIES
from tiny import colvision, make_image

QUERY = "A red cat sits on a blue mat"
PAGES = [make_image(64, 48, seed=1), make_image(100, 60, seed=2), make_image(56, 90, seed=3)]


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    tiny = tiny_checkpoints.model("colqwen2")
    processor = colvision.reference_processor(tiny)
    return processor, colvision.reference_vectors(tiny, processor)


@pytest.fixture(scope="module")
def server(retrieval_server):
    return retrieval_server


def post(server, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def test_openai_client_embeds_texts_and_images_as_floats(server, reference):
    _, vectors = reference
    client = server.openai_client(api_key=KEY)
    inputs = [QUERY, {"image": data_url(PAGES[0])}]
    result = client.embeddings.create(model="colqwen2", input=inputs, encoding_format="float")
    assert [d.index for d in result.data] == [0, 1]
    expected = [vectors(QUERY), vectors(PAGES[0])]
    for item, want in zip(result.data, expected):
        got = np.array(item.embedding, dtype=np.float32)  # one vector per token
        assert got.shape == want.shape and item.shape == list(want.shape)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert result.usage.prompt_tokens == sum(len(w) for w in expected)
    assert result.usage.total_tokens == result.usage.prompt_tokens


def test_openai_client_embeds_as_base64(server, reference):
    _, vectors = reference
    client = server.openai_client(api_key=KEY)
    result = client.embeddings.create(model="colqwen2", input=QUERY, encoding_format="base64")
    item = result.data[0]
    got = np.frombuffer(base64.b64decode(item.embedding), dtype="<f4").reshape(item.shape)
    np.testing.assert_allclose(got, vectors(QUERY), atol=1e-4, rtol=0)
    # the client's default asks for base64 and decodes it: the vectors, row after row
    flat = client.embeddings.create(model="colqwen2", input=QUERY).data[0].embedding
    np.testing.assert_allclose(np.array(flat), got.reshape(-1), atol=1e-6)


def test_rerank_sorts_the_documents_by_maxsim(server, reference):
    processor, vectors = reference
    documents = [{"image": data_url(page)} for page in PAGES] + ["a blue mat"]
    response = post(server, "/v1/rerank", {"model": "colqwen2", "query": QUERY,
                                           "documents": documents, "top_n": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = [colvision.reference_maxsim(processor, vectors(QUERY), vectors(d))
                for d in PAGES + ["a blue mat"]]
    order = sorted(range(4), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in body["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                               [expected[i] for i in order], atol=1e-4, rtol=1e-5)
    assert body["results"][0]["document"] == (
        {"text": "a blue mat"} if order[0] == 3 else documents[order[0]])
    assert body["usage"]["total_tokens"] > 0


def test_models_say_what_each_model_does(server):
    response = httpx.get(f"{server.base_url}/v1/models", timeout=30,
                         headers={"Authorization": f"Bearer {KEY}"})
    cards = {card["id"]: card["capabilities"] for card in response.json()["data"]}
    assert cards == SERVED_CAPABILITIES
    assert cards["colqwen2"] == ["embed", "rerank"] and cards["chat"] == ["chat"]


def test_wrong_kind_of_request_is_a_400(server):
    chat = post(server, "/v1/chat/completions", {
        "model": "colqwen2", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400
    assert chat.json()["error"]["code"] == "model_not_supported"
    assert "/v1/embeddings" in chat.json()["error"]["message"]
    embeddings = post(server, "/v1/embeddings", {"model": "chat", "input": "hi"})
    assert embeddings.status_code == 400
    assert "does not embed" in embeddings.json()["error"]["message"]
    rerank = post(server, "/v1/rerank", {"model": "chat", "query": "q", "documents": ["d"]})
    assert rerank.status_code == 400


def test_the_chat_routes_rules_apply(server, tmp_path):
    no_key = post(server, "/v1/embeddings", {"model": "colqwen2", "input": "hi"}, key="wrong")
    assert no_key.status_code == 401
    unknown = post(server, "/v1/embeddings", {"model": "nope", "input": "hi"})
    assert unknown.status_code == 404
    big = post(server, "/v1/embeddings", {"model": "colqwen2", "input": "x" * 300_000})
    assert big.status_code == 413
    # no --allowed-media-dir: local files are not read
    page = tmp_path / "page.png"
    PAGES[0].save(page)
    local = post(server, "/v1/embeddings", {"model": "colqwen2", "input": [{"image": str(page)}]})
    assert local.status_code == 400 and local.json()["error"]["param"] == "input"
    both = post(server, "/v1/embeddings", {"model": "colqwen2",
                                           "input": [{"text": "t", "image": data_url(PAGES[0])}]})
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]
    malformed = post(server, "/v1/embeddings", {"model": "colqwen2", "input": [{"img": "x"}]})
    assert malformed.status_code == 400
    too_long = post(server, "/v1/embeddings", {"model": "colqwen2", "input": "cat " * 1100})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    resized = post(server, "/v1/embeddings", {"model": "colqwen2", "input": "hi", "dimensions": 8})
    assert resized.status_code == 400 and resized.json()["error"]["param"] == "dimensions"


def test_colpali_is_served_too(server, tiny_checkpoints):
    tiny = tiny_checkpoints.model("colpali")
    vectors = colvision.reference_vectors(tiny)
    client = server.openai_client(api_key=KEY)
    result = client.embeddings.create(model="colpali", encoding_format="float",
                                      input=[{"image": data_url(PAGES[1])}, QUERY])
    for item, want in zip(result.data, [vectors(PAGES[1]), vectors(QUERY)]):
        np.testing.assert_allclose(np.array(item.embedding), want, atol=1e-4, rtol=0)
