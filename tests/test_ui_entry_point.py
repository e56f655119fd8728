"""The chat UI as users start it (``python -m mlxvlm.ui --model examples/shapes-vlm`` in a
subprocess) and call it: the /chat API needs only a message, every input has a name and
a default, and the page has a heading, a hint in the empty chat and one "Model" heading
(with two models offered).
Answers are checked against ``mlxvlm.generate`` on the same conversation."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from gradio_client import Client, handle_file

import mlxvlm
from server_process import UIProcess

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEMO = EXAMPLES / "shapes-vlm"
PICTURE = EXAMPLES / "images" / "blue-triangle.png"
WAIT_S = 120
# Offered in the picker beside the demo, never chosen (so never loaded): two models, as
# the picker shows them.
OTHER_MODEL = "mlx-community/not-loaded-here"
CHAT_PARAMETERS = ["message", "system_prompt", "temperature", "top_p", "max_tokens",
                   "repetition_penalty", "seed", "model_name", "speak_answers", "voice",
                   "talker_temperature"]


@pytest.fixture(scope="module")
def ui():
    with UIProcess("--model", str(DEMO), "--model", OTHER_MODEL,
                   env={"HF_HUB_OFFLINE": "1"}) as process:
        yield process


@pytest.fixture(scope="module")
def demo():
    return mlxvlm.load(DEMO)


def expected_answer(demo, text: str, *images: Path) -> str:
    """The UI's defaults: the checkpoint's greedy sampling, 256 new tokens, no system."""
    content = [{"type": "image", "image": str(p)} for p in images]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
    return mlxvlm.generate(*demo, messages, max_tokens=256).text


def header_cells(table: str) -> list[str]:
    return [cell.strip() for cell in table.splitlines()[0].strip().strip("|").split("|")]


def test_the_chat_api_needs_only_the_message(ui, demo):
    reply, figures = Client(ui.base_url, verbose=False).predict(
        "describe the picture", api_name="/chat")
    assert reply == expected_answer(demo, "describe the picture")
    cells = header_cells(figures)
    assert len(cells) == 2 and all(cells), figures  # no blank header cell
    assert "| prompt tokens |" in figures


def test_a_picture_through_the_api(ui, demo):
    question = "What is in the picture?"
    job = Client(ui.base_url, verbose=False).submit(
        {"text": question, "files": [handle_file(str(PICTURE))]}, api_name="/chat")
    reply, _ = job.result(timeout=WAIT_S)
    assert reply == expected_answer(demo, question, PICTURE)


def test_a_pdf_through_the_api(ui, demo, tmp_path):
    """A PDF upload (made here with Pillow: two example pictures, one per page): its
    pages are the turn's images, as mlxvlm renders the same file."""
    from pdf_documents import pdf_of

    from mlxvlm.media import load_pdf

    document = tmp_path / "two-pages.pdf"
    document.write_bytes(pdf_of("yellow-square.png", "red-circle.png"))
    question = "What is in the picture?"
    content = [*({"type": "image", "image": page} for page in load_pdf(document)),
               {"type": "text", "text": question}]
    expected = mlxvlm.generate(*demo, [{"role": "user", "content": content}],
                               max_tokens=256).text
    job = Client(ui.base_url, verbose=False).submit(
        {"text": question, "files": [handle_file(str(document))]}, api_name="/chat")
    reply, _ = job.result(timeout=WAIT_S)
    assert reply == expected


def test_every_api_input_and_output_has_a_name_and_every_input_a_default(ui):
    api = Client(ui.base_url, verbose=False).view_api(print_info=False, return_format="dict")
    endpoints = api["named_endpoints"]
    chat = endpoints["/chat"]
    assert [p["parameter_name"] for p in chat["parameters"]] == CHAT_PARAMETERS
    for endpoint, info in endpoints.items():
        for parameter in info["parameters"]:
            assert parameter["parameter_has_default"], (endpoint, parameter["parameter_name"])
            assert not parameter["label"].startswith("parameter_"), (endpoint, parameter)
        for value in info["returns"]:
            assert not value["label"].startswith("value_"), (endpoint, value)


def test_the_page_has_a_heading_a_hint_and_one_model_heading(ui):
    config = httpx.get(f"{ui.base_url}/config", timeout=WAIT_S).json()
    props = [component.get("props", {}) for component in config["components"]]
    markdown = [p.get("value") or "" for p in props if p.get("name") == "markdown"]
    assert any("<h1" in text and "mlxvlm" in text for text in markdown), markdown
    chatbot = next(p for p in props if p.get("name") == "chatbot")
    assert "image" in (chatbot.get("placeholder") or ""), chatbot  # the demo reads images
    shown = [p for p in props if p.get("visible", True)]
    model_headings = [p for p in shown if p.get("label") == "Model" and p.get("show_label")]
    model_headings += [p for p in shown if "**Model**" in str(p.get("value"))]
    assert len(model_headings) == 1, model_headings
