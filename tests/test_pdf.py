"""PDFs in, text out (issue 43): a document's pages rendered with pypdfium2 under page
and pixel limits (media/pdf.py), then answered through the entry points users run --
``python -m mlxvlm.generate`` (each page in turn, ``--output-dir``), ``python -m
mlxvlm.server`` (OpenAI's file part, Responses' input_file, Anthropic's document) and
``python -m mlxvlm.ui`` (a PDF upload: tests/test_ui_entry_point.py). The test PDFs are made here with Pillow, one
example picture per page, and the demo model's answer on each page is checked against
its answer on the picture itself."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
from pathlib import Path

import anthropic
import openai
import pytest
from PIL import Image

import mlxvlm
from mlxvlm.media import (MediaError, MediaLimitError, PixelBudget, PixelBudgetError,
                          load_image)
from mlxvlm.media.decode_work import PreparationCancelled, preparing
from mlxvlm.media.pdf import load_pdf, looks_like_pdf, parse_page_spec, select_pages
from pdf_documents import EXAMPLES, encrypted_pdf, pdf_of
from server_process import ServerProcess

DEMO = EXAMPLES / "shapes-vlm"
PICTURES = ["red-circle.png", "yellow-square.png", "blue-triangle.png"]
QUESTION = "What is in the picture?"
WAIT_S = 120


def data_url(pdf: bytes) -> str:
    return "data:application/pdf;base64," + base64.b64encode(pdf).decode()


@pytest.fixture(scope="module")
def demo():
    return mlxvlm.load(DEMO)


@pytest.fixture(scope="module")
def picture_answers(demo):
    """The demo model's answer on each example picture itself."""
    return {name: mlxvlm.generate(*demo, QUESTION, image=EXAMPLES / "images" / name,
                                  max_tokens=16).text.strip() for name in PICTURES}


@pytest.fixture(scope="module")
def three_pages(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pdf") / "shapes.pdf"
    path.write_bytes(pdf_of(*PICTURES))
    return path


# -- rendering ------------------------------------------------------------------------


def test_page_specs():
    assert parse_page_spec("1-3, 5,8-") == [(1, 3), (5, 5), (8, None)]
    assert select_pages("3,1-2,2", 4) == [3, 1, 2]
    assert select_pages("3-", 4) == [3, 4]
    assert select_pages(None, 2) == [1, 2]
    for bad, says in (("0", "numbered from 1"), ("3-1", "lower page"), ("1,x", "'x'"),
                      ("", "empty"), ("1-2-3", "not a page")):
        with pytest.raises(ValueError, match=says):
            parse_page_spec(bad)
    with pytest.raises(MediaError, match="it has 4 pages, and the page list asks for page 6"):
        select_pages("2-6", 4)


def test_pages_render_at_the_dpi_within_the_pixel_cap(three_pages):
    # red-circle.png is 128 x 128 pixels: a page of 128 x 128 points (1/72 inch).
    points = Image.open(EXAMPLES / "images" / PICTURES[0]).size
    pages = load_pdf(three_pages, pages="1", dpi=144)
    assert [page.size for page in pages] == [(points[0] * 2, points[1] * 2)]
    assert pages[0].mode == "RGB"
    capped = load_pdf(three_pages, pages="2-3", dpi=144, max_page_pixels=64 * 64)
    assert all(page.width * page.height <= 64 * 64 and page.width >= 63 for page in capped)
    # At 72 DPI the page is the picture again (JPEG-compressed in the PDF): the yellow
    # square's centre keeps its colour.
    picture = Image.open(EXAMPLES / "images" / PICTURES[1]).convert("RGB")
    page = load_pdf(three_pages, pages="2", dpi=72)[0]
    assert page.size == picture.size
    centre = (picture.width // 2, picture.height // 2)
    assert all(abs(a - b) <= 8 for a, b in zip(page.getpixel(centre), picture.getpixel(centre)))
    assert looks_like_pdf(three_pages) and looks_like_pdf(str(three_pages))
    assert looks_like_pdf(data_url(b"%PDF-1.4")) and not looks_like_pdf(EXAMPLES / "images" / PICTURES[0])


def test_limits_and_broken_files_are_one_line_errors(three_pages, tmp_path):
    with pytest.raises(MediaLimitError, match="it has 3 pages to read, more than the limit "
                       "of 2; send fewer pages, or raise --max-pdf-pages") as refused:
        load_pdf(three_pages, max_pages=2, pages_option="raise --max-pdf-pages")
    assert refused.value.limit == "max_pdf_pages"
    assert len(load_pdf(three_pages, pages="1-2", max_pages=2)) == 2
    budget = PixelBudget(per_request=128 * 128 * 2, total=10**9)
    with budget.request(), pytest.raises(PixelBudgetError, match="page 3"):
        load_pdf(three_pages, dpi=72)  # the third page passes the request's pixels
    assert budget.in_use == 0
    broken = {
        "encrypted": (encrypted_pdf(), "encrypted \\(password-protected\\)"),
        "truncated": (pdf_of(PICTURES[0])[:300], "corrupt or not a PDF"),
        "not a PDF": (b"GIF89a...", "not a PDF \\(no %PDF- header\\)"),
    }
    for what, (data, says) in broken.items():
        path = tmp_path / f"{what}.pdf"
        path.write_bytes(data)
        with pytest.raises(MediaError, match=f"^cannot load PDF .*: it (is|has) .*{says}") as e:
            load_pdf(path)
        assert "\n" not in str(e.value), what
    with pytest.raises(MediaError, match="media type is 'image/png', not application/pdf"):
        load_pdf("data:image/png;base64,AAAA")
    with pytest.raises(MediaError, match="it is a PDF, not an image; render its pages"):
        load_image(three_pages.read_bytes())


def test_a_cancelled_request_stops_between_pages(three_pages):
    cancel = threading.Event()
    cancel.set()
    with preparing(cancel), pytest.raises(PreparationCancelled, match="page 1"):
        load_pdf(three_pages)


# -- python -m mlxvlm.generate ----------------------------------------------------------


@pytest.fixture(scope="module")
def torch_free_env(tmp_path_factory) -> dict:
    """A user's environment: torch hidden (it is test-only), which keeps the command's
    start fast, and no Hub access."""
    site = tmp_path_factory.mktemp("torch-free-site")
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}


GENERATE = ["--model", str(DEMO), "--prompt", QUESTION, "--max-tokens", "16"]


def generate_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m mlxvlm.generate``'s main, in this process: (exit code, stdout,
    stderr)."""
    from mlxvlm.generate.__main__ import main

    capsys.readouterr()
    try:
        code = main([*GENERATE, *args])
    except SystemExit as e:  # the parser's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_answers_each_page_in_turn_into_markdown_files(three_pages, picture_answers,
                                                           torch_free_env, tmp_path):
    out = tmp_path / "pages"
    done = subprocess.run(
        [sys.executable, "-m", "mlxvlm.generate", *GENERATE, "--image", str(three_pages),
         "--pages", "3,1", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=WAIT_S, env=torch_free_env)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["page-001.md", "page-003.md"]
    for page in (1, 3):
        text = (out / f"page-{page:03d}.md").read_text()
        assert text == picture_answers[PICTURES[page - 1]] + "\n"
    assert "2/2 pages" in done.stderr  # the progress lines (stderr is not a terminal)


def test_cli_prints_pages_under_headers_and_one_page_as_one_answer(
        three_pages, picture_answers, capsys):
    code, out, err = generate_in_process(capsys, "--pdf", str(three_pages), "--pages", "1-2")
    assert code == 0, err
    assert out == "".join(f"## Page {n}\n\n{picture_answers[PICTURES[n - 1]]}\n\n"
                          for n in (1, 2))
    code, out, err = generate_in_process(capsys, "--pdf", str(three_pages), "--pages", "3")
    assert code == 0, err
    assert out == picture_answers[PICTURES[2]] + "\n"


def test_cli_refuses_with_one_line(three_pages, tmp_path, capsys):
    locked = tmp_path / "locked.pdf"
    locked.write_bytes(encrypted_pdf())
    cases = [
        (("--pdf", str(three_pages), "--pages", "2-x"), "argument --pages: '2-x' is not a page"),
        (("--pdf", str(three_pages), "--pages", "4"), "it has 3 pages, and the page list "
         "asks for page 4"),
        (("--pdf", str(locked)), "it is encrypted (password-protected)"),
        (("--pages", "1"), "--pages applies to a PDF"),
        (("--pdf", str(three_pages), "--image", str(three_pages)), "got 2 PDFs"),
    ]
    for args, says in cases:
        code, out, err = generate_in_process(capsys, *args)
        assert code == 2, (args, err)
        assert err.startswith("error: ") and says in err, err
        assert err.count("\n") == 1, err  # one line, no traceback


# -- python -m mlxvlm.server ------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--model", str(DEMO), "--max-pdf-pages", "2",
                       env={"HF_HUB_OFFLINE": "1"}) as process:
        yield process


def test_server_takes_openai_file_parts(server, demo, picture_answers):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")

    def ask(file: dict) -> str:
        reply = client.chat.completions.create(
            model=str(DEMO), max_tokens=16, temperature=0, messages=[{"role": "user", "content": [
                {"type": "file", "file": file}, {"type": "text", "text": QUESTION}]}])
        return reply.choices[0].message.content

    one = pdf_of(PICTURES[1])
    assert ask({"file_data": data_url(one), "filename": "square.pdf"}) == \
        picture_answers[PICTURES[1]]
    assert ask({"file_data": base64.b64encode(one).decode()}) == picture_answers[PICTURES[1]]
    # Two pages: both images of the one message, as the same pages rendered here.
    two = pdf_of(PICTURES[0], PICTURES[2])
    pages = load_pdf(two)
    content = [*({"type": "image", "image": page} for page in pages),
               {"type": "text", "text": QUESTION}]
    expected = mlxvlm.generate(*demo, [{"role": "user", "content": content}],
                               max_tokens=16).text
    assert ask({"file_data": data_url(two), "filename": "two.pdf"}) == expected

    for file, says in (
            ({"file_data": data_url(pdf_of(*PICTURES))}, "it has 3 pages to read, more than "
             "the limit of 2; send fewer pages, or raise --max-pdf-pages"),
            ({"file_data": data_url(encrypted_pdf())}, "encrypted (password-protected)"),
            ({"file_id": "file-abc"}, "file_id is not supported")):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(file)
        assert says in refused.value.message


def test_server_takes_responses_input_files_and_anthropic_documents(server, picture_answers):
    pdf = pdf_of(PICTURES[2])
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    response = client.responses.create(
        model=str(DEMO), max_output_tokens=16, temperature=0, input=[{"role": "user", "content": [
            {"type": "input_file", "file_data": data_url(pdf), "filename": "triangle.pdf"},
            {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == picture_answers[PICTURES[2]]
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    message = claude.messages.create(model=str(DEMO), max_tokens=16, messages=[{
        "role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                            "data": base64.b64encode(pdf).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == picture_answers[PICTURES[2]]
