"""The chat UI with a model that speaks: the tiny full Qwen3-Omni
(tests/tiny/qwen3_omni_speech.py), whose random talker never ends its speech by itself
(so every spoken answer runs to the chat's --max-speech-seconds: 12 frames of its codec,
24 samples each), beside the thinker-only tiny Qwen3-Omni, which does not speak.

- The chat function (``ChatSession.respond``) streams the written answer, then ends with
  the audio's message: a 24 kHz WAV whose samples are those ``mlxvlm.generate(...,
  audio_output=True)`` speaks for the same prompt, voice and talker temperature 0; with
  "speak answers" off, or for a model that does not speak, the answer is written only;
  an unknown voice is a notice naming the voices; the stop button (the generator closed)
  while the answer is spoken stops the talker, and the next turn is answered.
- The page shows the voice picker (the checkpoint's voices, the API's default voice
  first), the toggle and the talker's temperature only for a model that speaks.
- Through ``python -m mlxvlm.ui`` and gradio_client: the page's config has the picker;
  an answer's audio comes over Gradio's API (the file downloaded from the app) with the
  same samples; the conversation goes on with the audio in its history; a model that does
  not speak answers in text; in headless Chromium the audio plays in the chat and
  choosing the other model hides the speech controls.
"""

from __future__ import annotations

import shutil
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
from gradio_client import Client
from playwright.sync_api import expect, sync_playwright

from server_process import UIProcess

import mlxvlm
from mlxvlm.speech.wav import pcm16
from mlxvlm.ui.app import build_app, upload_media_options
from mlxvlm.ui.conversation import NOTICE_TITLE
from mlxvlm.ui.session import ChatSession
from mlxvlm.ui.spoken_answers import SPEAKING_TITLE

pytest.importorskip("torch")  # the tiny checkpoint is built with transformers' classes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FRAMES = 12
MAX_SPEECH_SECONDS = 0.012  # 12 frames of the tiny codec (1000 frames a second)
THINKER_TOKENS = 6
QUESTION = "Describe a red circle."
FOLLOW_UP = "And a square?"
VOICES = ["Aiden", "Chelsie", "Ethan"]
WAIT_S = 120
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def thinker_only(tiny_checkpoints):
    return str(tiny_checkpoints.path("qwen3_omni_moe", "hub"))


@pytest.fixture(scope="module")
def loaded(speaking_checkpoint):
    return mlxvlm.load(speaking_checkpoint)


@pytest.fixture(scope="module")
def session(loaded):
    session = ChatSession(*loaded, "tiny-omni", media_options=upload_media_options(),
                          max_speech_seconds=MAX_SPEECH_SECONDS).start()
    yield session
    session.close()


def reference(loaded, messages, voice: str | None = None) -> mlxvlm.GenerationOutput:
    model, processor = loaded
    return mlxvlm.generate(model, processor, messages, max_tokens=THINKER_TOKENS,
                           temperature=0.0, audio_output=True, voice=voice,
                           talker_temperature=0, talker_max_frames=FRAMES)


def expected_samples(output: mlxvlm.GenerationOutput) -> np.ndarray:
    samples = np.frombuffer(pcm16(output.audio), "<i2")
    assert len(samples) > 0
    return samples


def wav_samples(path: str) -> np.ndarray:
    with wave.open(path) as audio:
        assert (audio.getnchannels(), audio.getsampwidth(), audio.getframerate()) == \
            (1, 2, 24000)
        return np.frombuffer(audio.readframes(audio.getnframes()), "<i2")


def respond(session, message=QUESTION, history=(), **controls) -> list:
    controls = {"temperature": 0.0, "max_tokens": THINKER_TOKENS, "talker_temperature": 0,
                **controls}
    return [reply for reply, _ in session.respond(message, list(history), **controls)]


def is_audio(message) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, dict) and content.get("mime_type") == "audio/wav"


def test_a_spoken_answer_ends_with_the_audio_generate_speaks(session, loaded):
    expected = reference(loaded, [{"role": "user", "content": QUESTION}], "Chelsie")
    replies = respond(session, voice="chelsie")
    *streamed, final = replies
    assert [m["content"] for m in final[:-1]] == [expected.text]
    assert is_audio(final[-1])
    np.testing.assert_array_equal(wav_samples(final[-1]["content"]["path"]),
                                  expected_samples(expected))
    # the text came first, the audio only at the end
    texts = [r[0]["content"] for r in streamed if r and isinstance(r[0]["content"], str)]
    assert texts and all(expected.text.startswith(t) for t in texts)
    assert not any(is_audio(m) for r in streamed for m in r)
    assert "| spoken |" in session.stats_markdown() and "(Chelsie)" in session.stats_markdown()


def test_the_voice_and_the_toggle(session, loaded):
    default = respond(session)[-1]
    expected = reference(loaded, [{"role": "user", "content": QUESTION}])  # Ethan
    np.testing.assert_array_equal(wav_samples(default[-1]["content"]["path"]),
                                  expected_samples(expected))
    written = respond(session, speak=False)[-1]
    assert written == expected.text  # a plain written answer, no audio
    refused = respond(session, voice="alloy")[-1]
    assert refused["metadata"]["title"] == NOTICE_TITLE
    assert "'alloy'" in refused["content"]
    assert all(voice in refused["content"] for voice in VOICES)


def test_stop_while_speaking_stops_the_talker(loaded):
    # 4096 frames: seconds of speech the tiny talker would go on with
    session = ChatSession(*loaded, "tiny-omni", max_speech_seconds=4.096).start()
    try:
        cancelled = session.engine.stats.requests_cancelled
        turn = session.respond(QUESTION, [], temperature=0.0, max_tokens=THINKER_TOKENS,
                               talker_temperature=0)
        for reply, _ in turn:
            if any(m.get("metadata", {}).get("title") == SPEAKING_TITLE for m in reply):
                break  # the answer is written and being spoken
        turn.close()  # what Gradio does on the stop button
        deadline = time.monotonic() + WAIT_S
        while session.engine.stats.requests_cancelled == cancelled:
            assert time.monotonic() < deadline, "the talker was not stopped"
            time.sleep(0.05)
        reply = respond(session, speak=False)[-1]
        assert isinstance(reply, str) and reply
    finally:
        session.close()


def speech_components(config: dict) -> dict[str, dict]:
    return {c["props"]["elem_id"]: c["props"] for c in config["components"]
            if c.get("props", {}).get("elem_id") in ("voice", "speak", "talker-temperature")}


def test_the_speech_controls_show_only_for_a_model_that_speaks(session, thinker_only):
    shown = speech_components(build_app(session).get_config_file())
    assert set(shown) == {"voice", "speak", "talker-temperature"}
    assert all(props["visible"] is True for props in shown.values())
    assert [choice[1] for choice in shown["voice"]["choices"]] == VOICES
    assert shown["voice"]["value"] == "Ethan"  # the API's default
    assert shown["speak"]["value"] is True

    silent = ChatSession(*mlxvlm.load(thinker_only), "thinker")
    assert not silent.speaks
    hidden = speech_components(build_app(silent).get_config_file())
    assert set(hidden) == {"voice", "speak", "talker-temperature"}
    assert all(props["visible"] is False for props in hidden.values())
    reply = respond(silent.start())[-1]
    try:
        assert isinstance(reply, str)  # written only, the speech settings ignored
    finally:
        silent.close()


def test_an_answers_audio_is_shown_but_never_read_as_an_attachment(tmp_path):
    from mlxvlm.ui.uploads import AttachmentRefused, Uploads

    uploads = Uploads(tmp_path)
    path = uploads.keep_answer_audio(b"RIFF....WAVE")
    assert Path(path).parent == tmp_path.resolve() / "answers"
    uploads.require_upload(path)  # Gradio may show it, and take it back in the history
    with pytest.raises(AttachmentRefused):  # no conversation may send it to the model
        uploads.admit("conversation", {"text": "What is this?", "files": [path]}, [])
    with pytest.raises(AttachmentRefused):
        uploads.require_upload(tmp_path / "answers" / "guessed.wav")


# ------------------------------------------------------------- python -m mlxvlm.ui

@pytest.fixture(scope="module")
def ui(speaking_checkpoint, thinker_only):
    with UIProcess("--model", speaking_checkpoint, "--model", thinker_only,
                   "--max-speech-seconds", str(MAX_SPEECH_SECONDS),
                   env={"HF_HUB_OFFLINE": "1"}) as process:
        yield process


def ask(client: Client, text: str, **controls):
    controls = {"temperature": 0.0, "max_tokens": THINKER_TOKENS, "talker_temperature": 0,
                **controls}
    return client.predict(text, api_name="/chat", **controls)


def test_the_page_and_the_api_answer_aloud(ui, loaded):
    config = httpx.get(f"{ui.base_url}/config", timeout=WAIT_S).json()
    shown = speech_components(config)
    assert shown["voice"]["visible"] is True
    assert [choice[1] for choice in shown["voice"]["choices"]] == VOICES

    client = Client(ui.base_url, verbose=False)
    reply, figures = ask(client, QUESTION, voice="Aiden")
    conversation = [{"role": "user", "content": QUESTION}]
    expected = reference(loaded, conversation, "Aiden")
    assert reply[0] == {"role": "assistant", "content": expected.text}
    # the audio, downloaded from the app by gradio_client
    np.testing.assert_array_equal(wav_samples(reply[-1]["content"]),
                                  expected_samples(expected))
    assert "| spoken |" in figures

    # the next turn, with the audio in the conversation's history
    reply, _ = ask(client, FOLLOW_UP, voice="Aiden")
    conversation += [{"role": "assistant", "content": expected.text},
                     {"role": "user", "content": FOLLOW_UP}]
    expected = reference(loaded, conversation, "Aiden")
    assert reply[0] == {"role": "assistant", "content": expected.text}
    np.testing.assert_array_equal(wav_samples(reply[-1]["content"]),
                                  expected_samples(expected))


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("Chromium is not installed (Debian: apt-get install chromium)")
    return path


def test_in_the_browser_the_audio_plays_in_the_chat(ui, thinker_only, tmp_path):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(),
                                             args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(WAIT_S * 1000)
            page.goto(ui.base_url)
            expect(page.locator("#voice")).to_be_visible()
            textbox = page.locator("#message textarea")
            textbox.fill(QUESTION)
            textbox.press("Enter")
            audio = page.locator("#chat audio")
            audio.first.wait_for(state="attached")
            expect(textbox).to_be_editable()
            page.screenshot(path=str(tmp_path / "spoken.png"), full_page=True)

            # another model, which does not speak: the speech controls go
            page.locator("#model-picker input").click()
            page.get_by_role("option", name=Path(thinker_only).name).click()
            expect(page.locator("#voice")).to_be_hidden()
            expect(page.locator("#speak")).to_be_hidden()
        finally:
            browser.close()


def test_a_model_that_does_not_speak_answers_in_text(ui, thinker_only):
    reply, figures = ask(Client(ui.base_url, verbose=False), QUESTION,
                         model_name=thinker_only)
    assert isinstance(reply, str) and "| spoken |" not in figures
