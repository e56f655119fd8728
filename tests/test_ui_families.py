"""The chat UI with the newer families (tiny checkpoints, a live app on 127.0.0.1): an
uploaded image is answered as ``mlxvlm.generate`` answers it, and a follow-up turn keeps
the image in context, from the prefix cache -- PaddleOCR-VL at OCR length, LFM2-VL (its
convolution states) and Qwen3-Omni's thinker. The UI's own behaviour is
tests/test_ui.py's."""

from __future__ import annotations

import pytest

import mlxvlm
from mlxvlm.ui.app import build_app, upload_media_options
from mlxvlm.ui.session import ChatSession
from tiny import make_image

pytest.importorskip("gradio_client")
from test_ui import LiveApp, answer, ask, free_port, user  # noqa: E402

# Tokens of the first answer: PaddleOCR-VL's answers are long.
NEW_TOKENS = {"paddleocr_vl": 64, "lfm2_vl": 24, "qwen3_omni_moe": 24}


@pytest.fixture(scope="module", params=sorted(NEW_TOKENS))
def live(tiny_checkpoints, request):
    family = request.param
    model, processor = mlxvlm.load(tiny_checkpoints.path(family, "hub"))
    session = ChatSession(
        model, processor, f"tiny-{family}", media_options=upload_media_options()
    ).start()
    app = build_app(session).queue()
    app.launch(
        server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True
    )
    try:
        yield family, LiveApp(app.local_url, session, model, processor)
    finally:
        app.close()
        session.close()


def test_an_uploaded_image_is_answered_and_kept_for_the_next_turn(live, tmp_path):
    family, live = live
    page = tmp_path / "page.png"
    make_image(140, 84, seed=6).save(page)
    client = live.client()

    first, _ = answer(ask(client, "OCR:", page, max_tokens=NEW_TOKENS[family]))
    expected = live.expected([user("OCR:", page)], NEW_TOKENS[family])
    assert first == expected.text
    if family == "paddleocr_vl":  # the long answer is the point
        assert expected.generation_tokens == NEW_TOKENS[family]

    second, stats = answer(ask(client, "Table Recognition:"))
    conversation = [user("OCR:", page), live.assistant(first), user("Table Recognition:")]
    assert second == live.expected(conversation, 24).text
    assert "reused)" in stats and "(0 reused)" not in stats
