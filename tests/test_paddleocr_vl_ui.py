"""The chat UI with PaddleOCR-VL (tiny checkpoint, live app on 127.0.0.1): an uploaded
document image is answered at length as ``mlxvlm.generate`` answers it, and a follow-up
turn keeps the image in context. The UI's own behaviour is tests/test_ui.py's."""

from __future__ import annotations

import pytest

import mlxvlm
from mlxvlm.ui.app import build_app, upload_media_options
from mlxvlm.ui.session import ChatSession
from tiny import make_image

pytest.importorskip("gradio_client")
from test_ui import LiveApp, answer, ask, free_port, user  # noqa: E402

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def live(tiny_checkpoints):
    model, processor = mlxvlm.load(tiny_checkpoints.path("paddleocr_vl", "hub"))
    session = ChatSession(
        model, processor, "tiny-paddleocr-vl", media_options=upload_media_options()
    ).start()
    app = build_app(session).queue()
    app.launch(
        server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True
    )
    try:
        yield LiveApp(app.local_url, session, model, processor)
    finally:
        app.close()
        session.close()


def test_an_uploaded_page_is_answered_and_kept_for_the_next_turn(live, tmp_path):
    page = tmp_path / "page.png"
    make_image(140, 84, seed=6).save(page)
    client = live.client()

    first, _ = answer(ask(client, "OCR:", page, max_tokens=NEW_TOKENS))
    expected = live.expected([user("OCR:", page)], NEW_TOKENS)
    assert first == expected.text and expected.generation_tokens == NEW_TOKENS

    second, stats = answer(ask(client, "Table Recognition:"))
    conversation = [user("OCR:", page), live.assistant(first), user("Table Recognition:")]
    assert second == live.expected(conversation, 24).text
    assert "reused)" in stats and "(0 reused)" not in stats
