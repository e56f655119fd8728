"""Qwen3-VL-Embedding and Qwen3-VL-Reranker against a float32 torch reference written
from their official scripts (tests/retrieval_reference.py), on a tiny random Qwen3-VL
checkpoint in the Hub's layout with the sentence-transformers files the Hub repos carry
(tests/tiny/qwen3_vl_retrieval.py), loaded through ``mlxvlm.load``.

Embeddings of text, an image and both, in one padded batch, within 1e-4 and of unit
norm; the instruction is the system turn; reranker scores within 1e-4 with the same
ranking, the instruction respected; each checkpoint recognized as the Hub ships it (and
a plain Qwen3-VL checkpoint left a chat model); both through ``mlxvlm.embed`` /
``mlxvlm.rerank`` and through ``python -m mlxvlm.server`` (the openai client's
``embeddings.create``, ``/v1/rerank``, ``/v1/models``; the session's shared server of
tests/retrieval_fixtures.py). An embedder whose config says the head is untied but
whose weights lack it (as Qwen3-VL-Embedding-8B ships) loads and converts; a reranker or
chat model so saved is refused in one line. Conversions' model cards carry the Hub's
tasks (sentence-similarity, text-ranking).
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import mlx.core as mx
import numpy as np
import pytest

from retrieval_reference import reference_embeddings, reference_scores
from retrieval_fixtures import RETRIEVAL_KEY
from tiny import make_image

torch = pytest.importorskip("torch")

ATOL = 1e-4
IMAGE_A = make_image(100, 70, seed=1)  # resized to 96 x 64: 3 x 2 merged tokens
IMAGE_B = make_image(64, 150, seed=2)  # 160 x 64

ITEMS = [{"text": "A red cat sits on a blue mat."},
         {"image": IMAGE_A},
         {"text": "What is in the picture?", "image": IMAGE_B}]
QUERY = {"text": "A red cat on a mat"}
DOCUMENTS = [{"text": "A red cat sits on a blue mat next to a green plant."},
             {"image": IMAGE_A},
             {"text": "The quick brown fox jumps over the lazy dog.", "image": IMAGE_B},
             {"text": "Here is a photo of my garden."}]


def inputs(items):
    from mlxvlm.retrieval.use import RetrievalInput

    return [RetrievalInput(**item) for item in items]


@pytest.fixture(scope="module")
def tiny(qwen3_retrieval):
    return qwen3_retrieval.tiny


@pytest.fixture(scope="module")
def folders(qwen3_retrieval):
    return qwen3_retrieval.folders


@pytest.fixture(scope="module")
def embedder(folders):
    import mlxvlm

    return mlxvlm.load(folders["embedding"])


@pytest.fixture(scope="module")
def reranker(folders):
    import mlxvlm

    return mlxvlm.load(folders["reranker"])


def test_embeddings_match_transformers(tiny, embedder):
    model, processor = embedder
    encoded = model.retrieval.embed(model, processor, inputs(ITEMS))
    ours = np.stack(encoded.vectors)
    expected = reference_embeddings(tiny, ITEMS)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # The tolerance decides something: the inputs' vectors are far apart.
    assert np.abs(expected[1] - expected[2]).max() > 100 * ATOL
    # One input alone gives its row of the padded batch.
    alone = model.retrieval.embed(model, processor, inputs(ITEMS[2:]))
    np.testing.assert_allclose(alone.vectors[0], ours[2], atol=ATOL, rtol=0)


def test_the_instruction_is_the_system_turn(tiny, embedder):
    model, processor = embedder
    instruction = "Retrieve images or text relevant to the user's query"
    ours = np.stack(model.retrieval.embed(model, processor, inputs(ITEMS), instruction).vectors)
    expected = reference_embeddings(tiny, ITEMS, instruction)
    np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=0)
    assert np.abs(expected - reference_embeddings(tiny, ITEMS)).max() > 100 * ATOL
    # The script ends an instruction with a full stop where it has no punctuation.
    stopped = model.retrieval.embed(model, processor, inputs(ITEMS[:1]), instruction + ".")
    np.testing.assert_allclose(stopped.vectors[0], ours[0], atol=1e-6, rtol=0)


def test_documents_take_the_default_instruction_when_scored(tiny, embedder):
    model, processor = embedder
    instruction = "Find the picture this describes"
    scored = model.retrieval.score(model, processor, inputs([QUERY])[0], inputs(DOCUMENTS),
                                   instruction)
    query = reference_embeddings(tiny, [QUERY], instruction)[0]
    documents = reference_embeddings(tiny, DOCUMENTS)
    np.testing.assert_allclose(scored.scores, documents @ query, atol=ATOL, rtol=0)


@pytest.mark.parametrize("query, instruction", [
    (QUERY, None),
    ({"image": IMAGE_B}, "Find the text that describes the picture"),
])
def test_reranker_scores_match_transformers(tiny, reranker, query, instruction):
    model, processor = reranker
    scored = model.retrieval.score(model, processor, inputs([query])[0], inputs(DOCUMENTS),
                                   instruction)
    expected = reference_scores(tiny, query, DOCUMENTS, instruction)
    np.testing.assert_allclose(scored.scores, expected, atol=ATOL, rtol=0)
    assert list(np.argsort(scored.scores)) == list(np.argsort(expected))
    # A ranking the tolerance keeps: neighbours more than both scores' tolerances apart.
    assert np.diff(np.sort(expected)).min() > 2 * ATOL
    assert scored.tokens > 0


def test_reranker_instruction_changes_the_scores(tiny):
    default = reference_scores(tiny, QUERY, DOCUMENTS)
    instructed = reference_scores(tiny, QUERY, DOCUMENTS, "Find the text that describes it")
    assert np.abs(default - instructed).max() > 100 * ATOL


def test_checkpoints_are_recognized_as_the_hub_ships_them(folders, embedder, reranker):
    import mlxvlm
    from mlxvlm.retrieval.detection import detect_use
    from mlxvlm.retrieval.qwen3_vl_reranker import Qwen3VLReranker

    assert embedder[0].retrieval.kind == "single_vector"
    assert reranker[0].retrieval.kind == "reranker"
    tokenizer = reranker[1].tokenizer
    assert (reranker[0].retrieval.yes_id, reranker[0].retrieval.no_id) == (
        tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no"))
    config = {"model_type": "qwen3_vl"}
    assert detect_use(config, folders["plain"]) is None  # a chat model stays one
    named = detect_use(config, folders["named"])
    assert isinstance(named, Qwen3VLReranker) and named.yes_id is None
    assert mlxvlm.load(folders["plain"])[0].retrieval is None


def test_through_the_python_api(tiny, embedder, reranker, tmp_path):
    import mlxvlm

    picture = tmp_path / "a.png"
    IMAGE_A.save(picture)
    # A string, an image file, text with an image; batches of 2 cut the list.
    vectors = mlxvlm.embed(*embedder, [ITEMS[0]["text"], {"image": str(picture)}, ITEMS[2]],
                           batch_size=2)
    assert vectors.dtype == np.float32 and vectors.shape == (3, 64)
    np.testing.assert_allclose(vectors, reference_embeddings(tiny, ITEMS), atol=ATOL, rtol=0)
    scores = mlxvlm.rerank(*reranker, QUERY["text"], DOCUMENTS, batch_size=3)
    np.testing.assert_allclose(scores, reference_scores(tiny, QUERY, DOCUMENTS), atol=ATOL,
                               rtol=0)


def test_a_quantized_conversion_stays_an_embedder_and_a_reranker(folders, embedder, reranker,
                                                                  tmp_path):
    import mlxvlm
    from mlxvlm.convert import convert

    path = convert(str(folders["embedding"]), tmp_path / "embedding-8bit", quantize=True,
                   q_bits=8).path
    model, processor = mlxvlm.load(path)
    assert model.retrieval.kind == "single_vector"
    quantized = mlxvlm.embed(model, processor, ITEMS)
    assert (np.sum(quantized * mlxvlm.embed(*embedder, ITEMS), axis=1) > 0.99).all()
    path = convert(str(folders["reranker"]), tmp_path / "reranker-8bit", quantize=True,
                   q_bits=8).path
    retrieval = mlxvlm.load(path)[0].retrieval
    assert (retrieval.kind, retrieval.yes_id) == ("reranker", reranker[0].retrieval.yes_id)
    # The model card tags them as the Hub's repos are tagged.
    card = (path / "README.md").read_text()
    assert "pipeline_tag: text-ranking" in card and "mlxvlm.rerank(" in card
    card = (tmp_path / "embedding-8bit" / "README.md").read_text()
    assert "pipeline_tag: sentence-similarity" in card and "mlxvlm.embed(" in card


def untied_without_head(source, target):
    """``source`` as Qwen3-VL-Embedding-8B ships: config.json says the head is not tied,
    and the weights hold no ``lm_head.weight`` (the tiny checkpoints are tied: none)."""
    import shutil

    shutil.copytree(source, target, symlinks=True)
    config = json.loads((target / "config.json").read_text())
    names = [name for file in target.glob("*.safetensors") for name in mx.load(str(file))]
    assert names and not any("lm_head" in name for name in names)
    config["tie_word_embeddings"] = False
    if "tie_word_embeddings" in config.get("text_config", {}):
        config["text_config"]["tie_word_embeddings"] = False
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_an_embedder_without_its_untied_head_loads(tiny, folders, tmp_path):
    import mlxvlm
    from mlxvlm.convert import convert
    from mlxvlm.errors import CheckpointError, MlxvlmError

    model, processor = mlxvlm.load(untied_without_head(folders["embedding"], tmp_path / "emb"))
    assert model.retrieval.kind == "single_vector"
    assert not model.args.text.tie_word_embeddings
    np.testing.assert_allclose(mlxvlm.embed(model, processor, ITEMS),
                               reference_embeddings(tiny, ITEMS), atol=ATOL, rtol=0)
    with pytest.raises(MlxvlmError, match="no output head"):
        model.language_model.logits(mx.zeros((1, model.args.text.hidden_size)))
    # Converted, it stays a headless embedder.
    converted = convert(str(tmp_path / "emb"), tmp_path / "emb-mlx").path
    np.testing.assert_allclose(mlxvlm.embed(*mlxvlm.load(converted), ITEMS),
                               reference_embeddings(tiny, ITEMS), atol=ATOL, rtol=0)
    # A reranker reads the head's "yes" and "no" rows; a chat model generates with it.
    for name in ("reranker", "plain"):
        with pytest.raises(CheckpointError, match="Missing 1 parameters.*lm_head.weight") as refused:
            mlxvlm.load(untied_without_head(folders[name], tmp_path / name))
        assert "\n" not in str(refused.value)


def test_an_input_longer_than_the_context_is_refused(embedder, reranker):
    import mlxvlm
    from mlxvlm.errors import PromptTooLongError

    long_text = "A red cat sits on a blue mat. " * 200  # the tiny model's context: 1024
    with pytest.raises(PromptTooLongError, match="context"):
        mlxvlm.embed(*embedder, [long_text])
    with pytest.raises(PromptTooLongError, match="context"):
        mlxvlm.rerank(*reranker, "cat", [long_text])


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server decodes the same pixels
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_through_the_server(tiny, retrieval_server):
    server = retrieval_server  # tests/retrieval_fixtures.py: every tiny retrieval model
    client = server.openai_client(api_key=RETRIEVAL_KEY)
    result = client.embeddings.create(
        model="embedder", input=[ITEMS[0]["text"], {"image": data_url(IMAGE_A)}],
        encoding_format="float")
    got = np.array([item.embedding for item in result.data], dtype=np.float32)
    np.testing.assert_allclose(got, reference_embeddings(tiny, ITEMS[:2]), atol=ATOL, rtol=0)
    instruction = "Retrieve images or text relevant to the user's query."
    result = client.embeddings.create(model="embedder", input=ITEMS[0]["text"],
                                      encoding_format="base64",
                                      extra_body={"instruction": instruction})
    got = np.frombuffer(base64.b64decode(result.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(got, reference_embeddings(tiny, ITEMS[:1], instruction)[0],
                               atol=ATOL, rtol=0)

    headers = {"Authorization": f"Bearer {RETRIEVAL_KEY}"}
    documents = [DOCUMENTS[0]["text"], {"image": data_url(IMAGE_A)},
                 {"text": DOCUMENTS[2]["text"], "image": data_url(IMAGE_B)},
                 DOCUMENTS[3]["text"]]
    response = httpx.post(f"{server.base_url}/v1/rerank", timeout=120, headers=headers, json={
        "model": "reranker", "query": QUERY["text"], "documents": documents, "top_n": 3})
    assert response.status_code == 200, response.text
    expected = reference_scores(tiny, QUERY, DOCUMENTS)
    order = list(np.argsort(-expected)[:3])
    results = response.json()["results"]
    assert [r["index"] for r in results] == order
    np.testing.assert_allclose([r["relevance_score"] for r in results], expected[order],
                               atol=ATOL, rtol=0)

    cards = httpx.get(f"{server.base_url}/v1/models", timeout=30, headers=headers).json()["data"]
    capabilities = {c["id"]: c["capabilities"] for c in cards}
    assert (capabilities["embedder"], capabilities["reranker"]) == (["embed", "rerank"],
                                                                   ["rerank"])
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, headers=headers,
                      json={"model": "reranker", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400
