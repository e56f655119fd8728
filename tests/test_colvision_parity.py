"""ColQwen2 and ColPali against transformers' ColQwen2ForRetrieval and
ColPaliForRetrieval (float32, tiny random checkpoints saved in both layouts and loaded
through mlxvlm.load): the same token counts and vectors within 1e-4 for queries and page
images, alone and batched, and the same MaxSim scores and ranking as transformers'
score_retrieval; a conversion's model card tagged visual-document-retrieval."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import mlxvlm
from mlxvlm.errors import MlxvlmError
from mlxvlm.retrieval.api import NotARetrievalModelError, RetrievalOnlyModelError
from mlxvlm.retrieval.inputs import RetrievalInputError
from tiny import colvision, make_image

TOLERANCE = 1e-4
QUERIES = ["A red cat sits on a blue mat", "What changed between them?"]
PAGES = [make_image(64, 48, seed=1), make_image(100, 60, seed=2), make_image(56, 90, seed=3)]


FAMILIES = ("colqwen2", "colpali")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints, family):
    return tiny_checkpoints.model(family)


@pytest.fixture(scope="module")
def reference(tiny):
    processor = colvision.reference_processor(tiny)
    return processor, colvision.reference_vectors(tiny, processor)


@pytest.fixture(scope="module", params=["transformers", "hub"])
def loaded(request, tiny_checkpoints, family):
    """The family's checkpoint in each layout."""
    return mlxvlm.load(tiny_checkpoints.path(family, request.param))


@pytest.fixture(scope="module")
def one_layout(tiny_checkpoints, family):
    """The family's checkpoint in transformers' layout (the layouts load alike)."""
    return mlxvlm.load(tiny_checkpoints.path(family, "transformers"))


def as_input(item):
    return item if isinstance(item, str) else {"image": item}


def test_each_query_and_page_matches_transformers(loaded, reference):
    model, processor = loaded
    assert model.retrieval.kind == "multi_vector"
    _, vectors = reference
    for item in QUERIES + PAGES:
        ours = mlxvlm.embed(model, processor, [as_input(item)])[0]
        expected = vectors(item)
        assert ours.dtype == np.float32
        assert ours.shape == expected.shape  # one vector per token, the same tokens
        np.testing.assert_allclose(ours, expected, atol=TOLERANCE, rtol=0)


def test_a_mixed_batch_gives_each_input_its_own_vectors(one_layout, reference):
    model, processor = one_layout
    _, vectors = reference
    items = QUERIES + PAGES
    batched = mlxvlm.embed(model, processor, [as_input(i) for i in items], batch_size=len(items))
    for ours, item in zip(batched, items):
        np.testing.assert_allclose(ours, vectors(item), atol=TOLERANCE, rtol=0)


def test_scores_and_ranking_match_score_retrieval(one_layout, reference):
    model, processor = one_layout
    ref_processor, vectors = reference
    pages = [vectors(page) for page in PAGES]
    for query in QUERIES:
        ours = mlxvlm.rerank(model, processor, query, [{"image": p} for p in PAGES], batch_size=2)
        expected = [colvision.reference_maxsim(ref_processor, vectors(query), page)
                    for page in pages]
        np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=1e-5)
        assert np.argsort(ours).tolist() == np.argsort(expected).tolist()


def test_the_checkpoints_prompt_prefixes_are_used(tiny_checkpoints, tiny, family, tmp_path):
    directory = tmp_path / f"{family}-prefixed"
    shutil.copytree(tiny_checkpoints.path(family, "transformers"), directory)
    config = json.loads((directory / "processor_config.json").read_text())
    config["query_prefix"] = "Find: "
    (directory / "processor_config.json").write_text(json.dumps(config))
    model, processor = mlxvlm.load(directory)
    ref = colvision.reference_processor(tiny)
    ref.query_prefix = "Find: "
    inputs = ref(text=[QUERIES[0]])
    with torch.no_grad():
        expected = tiny.model(**inputs).embeddings[0].numpy()
    ours = mlxvlm.embed(model, processor, QUERIES[0])[0]
    assert ours.shape[0] == int(inputs["attention_mask"].sum())
    np.testing.assert_allclose(ours, expected, atol=TOLERANCE, rtol=0)


def test_inputs_the_model_cannot_take_are_refused(one_layout):
    model, processor = one_layout
    with pytest.raises(RetrievalInputError, match=r"inputs\[0\]: .*not both"):
        mlxvlm.embed(model, processor, [{"text": "a page", "image": PAGES[0]}])
    with pytest.raises(RetrievalInputError, match=r"inputs\[1\]: unknown key 'img'"):
        mlxvlm.embed(model, processor, ["ok", {"img": "x.png"}])
    with pytest.raises(RetrievalInputError, match="empty"):
        mlxvlm.embed(model, processor, [])
    with pytest.raises(MlxvlmError, match="batch_size must be a positive integer"):
        mlxvlm.embed(model, processor, ["a"], batch_size=0)


def test_a_long_list_shows_its_progress(one_layout, capsys):
    model, processor = one_layout
    capsys.readouterr()
    mlxvlm.embed(model, processor, QUERIES * 2, batch_size=3, progress=True)
    err = capsys.readouterr().err
    assert "embedding" in err and "4/4" in err
    mlxvlm.embed(model, processor, QUERIES * 2, batch_size=3)  # short lists: no bar
    assert "embedding" not in capsys.readouterr().err


def test_a_chat_model_has_no_retrieval_use(tiny_checkpoints):
    model, processor = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "transformers"))
    assert model.retrieval is None
    with pytest.raises(NotARetrievalModelError, match="no retrieval use"):
        mlxvlm.embed(model, processor, "a query")


def test_a_retrieval_model_does_not_generate(one_layout):
    model, processor = one_layout
    with pytest.raises(RetrievalOnlyModelError, match="embedding model .*mlxvlm.embed"):
        mlxvlm.generate(model, processor, "hello", max_tokens=2)
    with pytest.raises(RetrievalOnlyModelError):
        mlxvlm.batch_generate(model, processor, ["hello"], max_tokens=2)


def test_finetune_and_the_chat_refuse_a_retrieval_model(tiny_checkpoints, tmp_path, capsys):
    """Through their commands' main: one line each, before any training or page."""
    from finetune_helpers import small_dataset

    from mlxvlm.finetune.__main__ import main as finetune_main
    from mlxvlm.ui.__main__ import main as ui_main

    path = str(tiny_checkpoints.path("colqwen2", "transformers"))
    data = small_dataset(tmp_path / "data", count=2)
    assert finetune_main(["--model", path, "--data", str(data), "--iters", "1",
                          "--adapter-path", str(tmp_path / "adapters")]) == 2
    assert "embedding model" in capsys.readouterr().err
    assert not (tmp_path / "adapters").exists()
    assert ui_main(["--model", path, "--port", "0"]) == 2
    assert "embedding model" in capsys.readouterr().err
def test_a_conversion_is_tagged_for_document_retrieval(tiny_checkpoints, tmp_path):
    from mlxvlm.convert import convert

    path = convert(str(tiny_checkpoints.path("colqwen2", "hub")), tmp_path / "colqwen2-mlx").path
    assert mlxvlm.load(path)[0].retrieval.kind == "multi_vector"
    card = (path / "README.md").read_text()
    assert "pipeline_tag: visual-document-retrieval" in card
    assert "python -m mlxvlm.embed --model colqwen2-mlx" in card and "generate" not in card
