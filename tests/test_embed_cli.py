"""``python -m mlxvlm.embed``: a ranking against --query and a folder indexed to JSONL
as users run them (a subprocess, torch-free), vectors of texts and pictures (the
command's main in this process), each against transformers' ColQwen2ForRetrieval on the
same tiny checkpoint; user errors in one line with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from mlxvlm.embed.__main__ import main
from tiny import colvision, make_image

QUERY = "A red cat sits on a blue mat"


def start_embed(*args: str) -> subprocess.Popen:
    env = {**os.environ}
    env.pop("MLXVLM_ALLOW_TORCH", None)  # as a user's process runs
    return subprocess.Popen([sys.executable, "-m", "mlxvlm.embed", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return str(tiny_checkpoints.path("colqwen2", "transformers"))


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    tiny = tiny_checkpoints.model("colqwen2")
    processor = colvision.reference_processor(tiny)
    return processor, colvision.reference_vectors(tiny, processor)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pictures")
    for i, (w, h) in enumerate([(64, 48), (100, 60), (56, 90)]):
        make_image(w, h, seed=10 + i).save(folder / f"page{i}.png")
    (folder / "notes.txt").write_text("not a picture")
    return folder


def test_texts_and_pictures_print_their_vectors(checkpoint, pictures, reference, capsys):
    _, vectors = reference
    page = pictures / "page1.png"
    assert main(["--model", checkpoint, "--text", QUERY, "--image", str(page),
                 "--print-vectors"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["input"] for line in lines] == [f"text: {QUERY}", f"image: {page}"]
    for line, item in zip(lines, [QUERY, Image.open(page)]):
        want = vectors(item)
        assert line["shape"] == list(want.shape) and line["tokens"] == want.shape[0]
        np.testing.assert_allclose(np.array(line["embedding"]), want, atol=1e-4, rtol=0)


def test_query_ranks_a_folder_and_the_index_holds_every_picture(checkpoint, pictures,
                                                                reference, tmp_path):
    processor, vectors = reference
    pages = sorted(pictures.glob("*.png"))
    index = tmp_path / "index.jsonl"
    # Two independent runs, started together (most of each is its single-threaded start)
    # while this process computes the reference.
    ranking_run = start_embed("--model", checkpoint, "--query", QUERY,
                              "--input-dir", str(pictures))
    indexing_run = start_embed("--model", checkpoint, "--input-dir", str(pictures),
                               "--output", str(index), "--batch-size", "2")
    try:
        expected = [colvision.reference_maxsim(processor, vectors(QUERY), vectors(Image.open(p)))
                    for p in pages]
        ranked, indexed = finished(ranking_run), finished(indexing_run)
    finally:
        for run in (ranking_run, indexing_run):
            if run.poll() is None:
                run.kill()
                run.wait()

    assert ranked.returncode == 0, ranked.stderr
    ranking = [json.loads(line) for line in ranked.stdout.splitlines()]
    assert [r["input"] for r in ranking] == [str(pages[i]) for i in np.argsort(expected)[::-1]]
    np.testing.assert_allclose([r["score"] for r in ranking], sorted(expected, reverse=True),
                               atol=1e-4, rtol=1e-5)

    assert indexed.returncode == 0, indexed.stderr
    assert "indexing" in indexed.stderr and "indexed 3 pictures" in indexed.stderr  # progress
    rows = [json.loads(line) for line in index.read_text().splitlines()]
    assert [row["path"] for row in rows] == [str(p) for p in pages]
    for row, page in zip(rows, pages):
        np.testing.assert_allclose(np.array(row["embedding"]), vectors(Image.open(page)),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("args, says", [
    (["--input-dir", "/no/such/folder"], "error: --input-dir '/no/such/folder' is not a folder"),
    (["--image", "/no/such/page.png"], "error: cannot load image"),
    ([], "error: nothing to embed"),
])
def test_user_errors_are_one_line_and_exit_code_2(args, says, capsys):
    try:
        code = main(["--model", "/unused", *args])
    except SystemExit as exit:  # argparse's refusals
        code = exit.code
    stderr = capsys.readouterr().err
    assert code == 2
    assert stderr.startswith(says) and stderr.count("\n") == 1, stderr


def test_a_chat_model_is_refused_in_one_line(tiny_checkpoints, capsys):
    chat_model = str(tiny_checkpoints.path("qwen2_vl", "transformers"))
    capsys.readouterr()  # what building the checkpoint printed
    assert main(["--model", chat_model, "--text", "hi"]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: this model generates text and has no retrieval use")
