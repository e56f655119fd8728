"""Granite-Docling (``granite_docling``) against transformers' GraniteDoclingForConditionalGeneration
(float32, PIL processor), on a tiny random checkpoint in both layouts (tests/tiny/granite_docling.py).

Parity: first-pass logits within 1e-4 and 24 greedy tokens for text, one image (2 x 2
tiles and the thumbnail), two images of different shapes and an image in a later turn;
the fine connector path (``fine_route`` in the checkpoint's preprocessor config); the same
answer through the CLI's ``main``; two requests decoded together and a later turn reusing
the cached prefix through ``python -m mlxvlm.server``.
DocTags: a page's DocTags (a table, a heading, a list) converted by docling-core through the
CLI (``--output-format``, one image and a PDF's ``--output-dir``) and the server's
``output_format``; a model that does not answer in DocTags is refused.
Guards: another image changes the answer, dropping the DeepStack rows or a wrong rope θ
is caught.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import mlx.core as mx
import numpy as np
import pytest

import parity
from parity import (
    LOGITS_ATOL,
    assert_another_image_changes_the_output,
    assert_wrong_model_is_caught,
    load_transformers_model,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    parameter_list,
    read_config,
    reference_fixture,
    standard_cases,
    standard_parity_tests,
    transformers_logits,
)
from tiny import make_image
from tiny.granite_docling import IMAGE_SEQ_LEN, LAYOUTS, SAMPLING, reference_processor
from mlxvlm import load
from mlxvlm.models import get_family

torch = pytest.importorskip("torch")
docling = pytest.importorskip("docling_core.types.doc.document")

FAMILY = "granite_docling"
IMAGE_A = make_image(112, 84, seed=1)  # 2 x 2 tiles + the thumbnail
IMAGE_WIDE = make_image(112, 40, seed=2)  # 1 x 3 tiles + the thumbnail
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_WIDE, IMAGE_A2)
reference = reference_fixture(reference_processor)

# A page as Granite-Docling writes it: locations, a heading, text, a table in OTSL
# (column headers, then rows) and a list.
PAGE_DOCTAGS = (
    "<doctag><page_header><loc_30><loc_20><loc_200><loc_30>ACME Annual Report</page_header>"
    "<section_header_level_1><loc_30><loc_40><loc_300><loc_55>Sales by region"
    "</section_header_level_1>"
    "<text><loc_30><loc_60><loc_470><loc_90>Sales grew in every region this year.</text>"
    "<otsl><loc_30><loc_100><loc_470><loc_180><ched>Region<ched>Sales<nl>"
    "<fcel>North<fcel>120<nl><fcel>South<fcel>95<nl></otsl>"
    "<unordered_list><list_item><loc_30><loc_190><loc_470><loc_200>North grew fastest."
    "</list_item></unordered_list></doctag>"
)

test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests([(FAMILY, layout) for layout in LAYOUTS], CASES)
)


def reference_text(processor, ref) -> str:
    return processor.tokenizer.decode(ref.tokens, skip_special_tokens=True)


def test_one_image_matches_transformers_for_64_tokens(tiny_checkpoints, loaded):
    """A page's answer is long: 64 greedy tokens, the same as transformers'."""
    model, processor = loaded(FAMILY, "hub")
    tiny = tiny_checkpoints.model(FAMILY)
    ref = parity.reference_run(tiny.model, reference_processor(tiny), *CASES["one_image"],
                               new_tokens=64)
    assert len(ref.tokens) == 64, "the reference stopped early; pick another seed"
    assert ref.margin > parity.MIN_REFERENCE_MARGIN, f"margin {ref.margin:.2e} is too thin"
    assert parity.our_tokens(model, processor, *CASES["one_image"], max_tokens=64) == ref.tokens


def test_the_cases_cover_the_tile_layouts(loaded, reference):
    """One image is 2 x 2 tiles and the thumbnail, the wide one 1 x 3 and the thumbnail."""
    _, processor = loaded(FAMILY, "hub")
    ids = reference(FAMILY, "two_images").input_ids
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_token) == (5 + 4) * IMAGE_SEQ_LEN
    for tile in ("<row_2_col_2>", "<row_1_col_3>", "<global-img>"):
        assert processor.tokenizer.convert_tokens_to_ids(tile) in ids


def test_fine_route_matches_transformers(tmp_path, tiny_checkpoints):
    """A checkpoint whose processor takes the fine path (four times the tokens per tile,
    the fine connector and its DeepStack mergers)."""
    path = tmp_path / "fine"
    shutil.copytree(tiny_checkpoints.path(FAMILY, "hub"), path)
    config = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**config, "fine_route": True}))
    model, processor = load(path)
    tiny = tiny_checkpoints.model(FAMILY)
    ref = parity.reference_run(tiny.model, reference_processor(tiny, fine_route=True),
                               *CASES["one_image"])
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert ref.input_ids.count(image_token) == 5 * 4 * IMAGE_SEQ_LEN
    parity.assert_first_pass_matches(model, processor, CASES["one_image"], ref)
    assert parity.our_tokens(model, processor, *CASES["one_image"]) == ref.tokens


def test_chunked_prefill_gives_the_same_tokens(loaded, reference):
    """Chunks of 5 tokens cut through the images' runs, and so through the DeepStack rows."""
    model, processor = loaded(FAMILY, "transformers")
    assert parity.our_tokens(model, processor, *CASES["two_images"], prefill_step_size=5) == (
        reference(FAMILY, "two_images").tokens)


def test_sampling_defaults_come_from_generation_config(loaded):
    _, processor = loaded(FAMILY, "hub")
    defaults = processor.sampling_defaults.values
    assert {k: defaults[k] for k in ("temperature", "top_p", "top_k")} == {
        k: SAMPLING[k] for k in ("temperature", "top_p", "top_k")}


# --------------------------------------------------------------------- entry points


def test_cli_prints_the_reference_answer(tmp_path, capsys, tiny_checkpoints, loaded, reference):
    from mlxvlm.generate.__main__ import main

    image = tmp_path / "page.png"
    IMAGE_A.save(image)
    code = main(["--model", str(tiny_checkpoints.path(FAMILY, "hub")), "--image", str(image),
                 "--prompt", "Describe this image.", "--max-tokens", str(parity.NEW_TOKENS),
                 "--temperature", "0"])
    assert code in (0, None)
    _, processor = loaded(FAMILY, "hub")
    assert capsys.readouterr().out.rstrip("\n") == reference_text(
        processor, reference(FAMILY, "one_image"))


def test_server_entry_point_batches_requests_and_converts_doctags(tiny_checkpoints, loaded,
                                                                  reference):
    """``python -m mlxvlm.server`` as users start it: an image request and a text one in
    flight at once (one batched decode), then a later turn with an image reusing the first
    turn's cached prefix; each answer is transformers'. The image request again with
    ``output_format``: "doctags" keeps the answer's tags, "markdown" is docling-core's
    conversion of that DocTags."""
    from concurrent.futures import ThreadPoolExecutor

    from server_harness import png_data_url, user
    from server_process import ServerProcess

    from mlxvlm.text.doctags import convert, doctags_token_ids

    _, processor = loaded(FAMILY, "hub")
    image_request = [user("Describe this image.", png_data_url(IMAGE_A))]
    requests = {"one_image": image_request,
                "text": [{"role": "user", "content": CASES["text"][0][0]["content"]}]}
    with ServerProcess("--model", str(tiny_checkpoints.path(FAMILY, "hub")),
                       "--served-model-name", "docling") as server:
        client = server.openai_client()

        def ask(messages, **extra):
            return client.chat.completions.create(
                model="docling", messages=messages, max_tokens=parity.NEW_TOKENS,
                temperature=0.0, extra_body=extra or None)

        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(requests, pool.map(ask, requests.values())))
        for case, answer in answers.items():
            ref = reference(FAMILY, case)
            assert answer.choices[0].message.content == reference_text(processor, ref)
            assert answer.usage.prompt_tokens == len(ref.input_ids)

        messages, images = CASES["image_in_second_turn"]
        first = ask([messages[0]])
        later = ask([messages[0], messages[1],
                     user("What is in this picture?", png_data_url(images[0]))])

        doctags = ask(image_request, output_format="doctags").choices[0].message.content
        markdown = ask(image_request, output_format="markdown").choices[0].message.content
    assert later.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert later.choices[0].message.content == reference_text(
        processor, reference(FAMILY, "image_in_second_turn"))
    # the answer with its DocTags tags, and no other special token
    tokenizer, tags = processor.tokenizer, doctags_token_ids(processor)
    tokens = reference(FAMILY, "one_image").tokens
    assert any(t in tags for t in tokens)  # the random answer holds some tags
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    kept = [t for t in tokens if t in tags or t not in special]
    assert doctags == tokenizer.decode(kept)
    assert markdown == convert(doctags.strip(), "markdown")


# ------------------------------------------------------------------ DocTags answers


def scripted_page(monkeypatch, processor) -> None:
    """Every answer from now on is PAGE_DOCTAGS, then the end of the sequence."""
    from scripted_tokens import script_tokens

    tokenizer = processor.tokenizer
    ids = tokenizer.encode(PAGE_DOCTAGS, add_special_tokens=False)
    assert tokenizer.decode(ids) == PAGE_DOCTAGS  # the tags are tokens, the text round-trips
    script_tokens(monkeypatch, ids + [tokenizer.eos_token_id])


def docling_markdown(doctags: str, image=None) -> str:
    """docling-core's own Markdown for one page's DocTags."""
    from docling_core.types.doc.doctags import DocTagsDocument

    pages = DocTagsDocument.from_doctags_and_image_pairs([doctags], None if image is None else [image])
    return docling.DoclingDocument.load_from_doctags(pages, document_name="page").export_to_markdown()


def assert_table_row(markdown: str) -> None:
    """The OTSL table's second row is a Markdown table row (checked by hand)."""
    assert re.search(r"^\|\s*North\s*\|\s*120\s*\|$", markdown, re.MULTILINE), markdown
    assert "# Sales by region" in markdown


def test_cli_converts_a_doctags_page_to_markdown(monkeypatch, tmp_path, capsys, tiny_checkpoints,
                                                 loaded):
    from mlxvlm.generate.__main__ import main

    _, processor = loaded(FAMILY, "hub")
    scripted_page(monkeypatch, processor)
    image = tmp_path / "page.png"
    IMAGE_A.save(image)
    model = str(tiny_checkpoints.path(FAMILY, "hub"))
    outputs = {}
    for fmt in ("markdown", "doctags", "json"):
        code = main(["--model", model, "--image", str(image), "--prompt", "Convert this page to docling.",
                     "--max-tokens", "400", "--temperature", "0", "--output-format", fmt])
        assert code in (0, None)
        outputs[fmt] = capsys.readouterr().out.rstrip("\n")
    assert outputs["doctags"] == PAGE_DOCTAGS
    from PIL import Image

    assert outputs["markdown"] == docling_markdown(PAGE_DOCTAGS, Image.open(image))
    assert_table_row(outputs["markdown"])
    texts = [item["text"] for item in json.loads(outputs["json"])["texts"]]
    assert "Sales grew in every region this year." in texts


def test_cli_writes_a_pdfs_pages_as_converted_markdown(monkeypatch, tmp_path, capsys,
                                                       tiny_checkpoints, loaded):
    from pdf_documents import pdf_of

    from mlxvlm.generate.__main__ import main

    _, processor = loaded(FAMILY, "hub")
    scripted_page(monkeypatch, processor)
    pdf = tmp_path / "doc.pdf"
    pdf.write_bytes(pdf_of("red-circle.png", "blue-triangle.png"))
    out = tmp_path / "pages"
    code = main(["--model", str(tiny_checkpoints.path(FAMILY, "hub")), "--pdf", str(pdf),
                 "--output-dir", str(out), "--max-tokens", "400", "--temperature", "0",
                 "--output-format", "markdown"])
    assert code in (0, None)
    assert sorted(p.name for p in out.iterdir()) == ["page-001.md", "page-002.md"]
    for page in out.iterdir():
        text = page.read_text().rstrip("\n")
        assert text == docling_markdown(PAGE_DOCTAGS)
        assert_table_row(text)


def test_output_format_is_refused_where_it_cannot_be_served(monkeypatch, tmp_path, capsys,
                                                             tiny_checkpoints):
    """A model whose tokenizer has no <doctag>: the CLI's one-line error, the server's 400.
    Where docling-core cannot be imported: the CLI's error naming the extra, the server's
    501 (the request is right, the server lacks the library). A conversion asked with
    ``stream``: a 400 (it needs the whole answer)."""
    from server_harness import user
    from server_process import ServerProcess

    import openai

    from mlxvlm.generate.__main__ import main

    docling_path = str(tiny_checkpoints.path(FAMILY, "hub"))
    other = str(tiny_checkpoints.path("idefics3", "hub"))  # no <doctag> in its tokenizer
    image = tmp_path / "page.png"
    IMAGE_A.save(image)
    capsys.readouterr()
    assert main(["--model", other, "--image", str(image), "--output-format", "markdown"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: --output-format markdown needs a model that answers in DocTags")

    missing = tmp_path / "site" / "docling_core"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError('no docling-core here')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(missing.parent), os.environ.get("PYTHONPATH", "")])}
    with ServerProcess("--model", other, "--model", docling_path, env=env) as server:
        client = server.openai_client()

        def refusal(model, **extra):
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(model=model, messages=[user("Hi")], max_tokens=4,
                                               **extra)
            return caught.value

        not_doctags = refusal(other, extra_body={"output_format": "markdown"})
        streamed = refusal(other, stream=True, extra_body={"output_format": "html"})
        no_library = refusal(docling_path, extra_body={"output_format": "doctags"})
    assert not_doctags.status_code == 400 and not_doctags.body["param"] == "output_format"
    assert "answers in DocTags" in not_doctags.body["message"]
    assert streamed.status_code == 400 and "stream" in streamed.body["message"]
    assert no_library.status_code == 501 and "mlxvlm[docs]" in no_library.body["message"]

    monkeypatch.setitem(sys.modules, "docling_core.types.doc", None)  # import fails
    assert main(["--model", docling_path, "--prompt", "Hi", "--output-format", "doctags"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: DocTags output needs docling-core: pip install 'mlxvlm[docs]' (docling-core)")


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "hub")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_dropping_the_deepstack_rows_would_be_caught(loaded, reference):
    """The tiny tower's DeepStack rows weigh in the logits far beyond the parity tolerance,
    so the parity tests check them (the fine path's mergers: its own parity test)."""
    model, processor = loaded(FAMILY, "hub")
    ids, embeddings, state = parity.embedded(model, processor, *CASES["one_image"])
    assert state is not None and len(state.deepstack.layers) == 2
    without = parity.first_pass(model, ids, embeddings, None)
    assert np.abs(without - reference(FAMILY, "one_image").logits).max() > parity.CAUGHT


def test_wrong_rope_theta_would_be_caught(tiny_checkpoints, loaded, reference):
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    del config["text_config"]["rope_parameters"]
    model, processor = loaded(FAMILY, "hub")
    assert_wrong_model_is_caught(get_family(FAMILY).Model.from_config(config), model, processor,
                                 CASES["image_in_second_turn"], reference(FAMILY, "image_in_second_turn"))


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it (ignoring its mtp.*
    tensors) into the same model."""
    path = tiny_checkpoints.path(FAMILY, "hub")
    processor = get_family(FAMILY).load_processor(path, {})
    logits = transformers_logits(load_transformers_model(path), processor, *CASES["two_images"])
    np.testing.assert_allclose(logits, reference(FAMILY, "two_images").logits, rtol=0, atol=1e-6)


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == new
    assert new.vision.deepstack_visual_indexes == (0, 2) and new.vision.use_fine_route
    assert (new.text.embedding_multiplier, new.text.logits_scaling) == (3.0, 2.5)


def test_sanitized_names_leave_the_prediction_head_out(tiny_checkpoints, loaded):
    module = get_family(FAMILY)
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    weights = mx.load(str(tiny_checkpoints.path(FAMILY, "hub") / "model.safetensors"))
    assert any(name.startswith("mtp.") for name in weights)
    assert module.is_hf_checkpoint(weights.keys())
    kept = {k: v for k, v in weights.items() if not k.startswith(module.UNUSED)}
    assert set(model.sanitize(kept)) == expected
    for name in ("vision_model.embeddings.patch_embedding.weight",
                 "vision_model.encoder.layers.3.mlp.fc2.weight",
                 "vision_model.connector.coarse.deepstack_mergers.1.linear_2.weight",
                 "vision_model.connector.fine.projection.weight",
                 "vision_model.connector.ln_out.bias",
                 "language_model.layers.2.self_attn.o_proj.weight"):
        assert name in expected, name
    assert "language_model.lm_head.weight" not in expected  # tied


def test_an_mlx_layout_checkpoint_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    model, _ = loaded(FAMILY, "hub")
    path = parity.save_as_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path)
    mlx_model, processor = load(path)
    _, logits = parity.our_logits(mlx_model, processor, *CASES["two_images"])
    np.testing.assert_allclose(logits, reference(FAMILY, "two_images").logits, rtol=0,
                               atol=LOGITS_ATOL)
