"""The chat's model picker and the media each model takes (tiny checkpoints, a live app on
127.0.0.1): choosing a model loads it and unloads the other, the message box offers what
the chosen model takes (the microphone for a model that hears), and an uploaded or
recorded sound reaches Qwen2.5-Omni's audio features, a video its video path, each
answered as ``mlxvlm.generate`` answers it."""

from __future__ import annotations

import time
import weakref
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

import mlxvlm
from mlxvlm.ui import session as session_module
from mlxvlm.ui.app import build_app, upload_media_options
from mlxvlm.ui.models import ModelRegistry
from mlxvlm.ui.session import ChatSession
from mlxvlm.ui.uploads import process_uploads
from av_media import coloured_frames, sine, write_audio, write_video

pytest.importorskip("gradio_client")
from test_ui import (  # noqa: E402
    CHROMIUM_ARGS, WAIT_S, LiveApp, answer, ask, chromium_path, free_port)

FAMILIES = ("qwen2_vl", "qwen2_5_omni")  # images and videos; and sound too


class Models:
    """The live app's registry, with a log of what was loaded and unloaded."""

    def __init__(self, tiny_checkpoints):
        self.paths = {str(tiny_checkpoints.path(f, "hub")): f for f in FAMILIES}
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.registry = ModelRegistry(list(self.paths), self.open)

    def open(self, name: str) -> ChatSession:
        model, processor = mlxvlm.load(name)
        session = ChatSession(model, processor, name, media_options=upload_media_options())
        # Weakly: the session holding a closure over its own method would be a cycle,
        # which only the garbage collector frees (the test below checks that unloading
        # frees the model at once).
        close = weakref.WeakMethod(session.close)

        def logged_close():
            self.closed.append(self.paths[name])
            close()()

        session.close = logged_close
        self.opened.append(self.paths[name])
        return session.start()

    def name(self, family: str) -> str:
        return next(name for name, f in self.paths.items() if f == family)


@pytest.fixture(scope="module")
def live(tiny_checkpoints):
    models = Models(tiny_checkpoints)
    app = build_app(models.registry).queue()
    app.launch(
        server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True
    )
    try:
        yield app, models
    finally:
        app.close()
        models.registry.close()


def choose(app, client, name: str):
    """Choose ``name`` in ``client``'s page; the attachment box that page now has."""
    client.predict(name, api_name="/choose_model")
    box = next(b for b in app.blocks.values() if getattr(b, "elem_id", None) == "message")
    state = app.state_holder[client.session_hash]
    return state[box._id] if box._id in state else box


def new_client(app):
    return LiveApp(app.local_url, None, None, None).client()


def seen_inputs(monkeypatch) -> list:
    """The (messages, prepared inputs) of every turn from now on."""
    seen = []
    prepare = session_module.prepare_inputs

    def spy(processor, messages, **kwargs):
        seen.append((messages, prepare(processor, messages, **kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(session_module, "prepare_inputs", spy)
    return seen


def message(kind: str, path: Path, text: str) -> dict:
    return {"role": "user", "content": [{"type": kind, kind: str(path)},
                                        {"type": "text", "text": text}]}


def test_choosing_a_model_loads_it_unloads_the_other_and_offers_its_media(live):
    app, models = live
    omni, qwen = models.name("qwen2_5_omni"), models.name("qwen2_vl")
    assert models.registry.loaded == [qwen] and models.opened == ["qwen2_vl"]
    client = new_client(app)
    box = next(b for b in app.blocks.values() if getattr(b, "elem_id", None) == "message")
    assert (box.sources, box.file_types) == (["upload"], ["image", ".pdf", "video"])
    first, _ = answer(ask(client, "Hello?"))
    with models.registry.use(qwen) as session:
        unloaded = weakref.ref(session.model)
    del session

    box = choose(app, client, omni)
    assert models.registry.loaded == [omni] and models.closed == ["qwen2_vl"]
    assert unloaded() is None, "the unloaded model is still referenced"
    assert box.sources == ["upload", "microphone"]
    assert box.file_types == ["image", ".pdf", "video", "audio"]
    # A new conversation: the omni model answers as if nothing came before.
    reply, _ = answer(ask(client, "Hello?", model_name=omni))
    with models.registry.use(omni) as session:
        expected = mlxvlm.generate(session.model, session.processor,
                                   [{"role": "user", "content": "Hello?"}], max_tokens=24)
    assert reply == expected.text != first

    box = choose(app, client, qwen)
    assert models.registry.loaded == [qwen] and models.closed == ["qwen2_vl", "qwen2_5_omni"]
    assert box.sources == ["upload"]


def test_a_turn_for_an_unloaded_model_loads_it(live):
    app, models = live
    omni = models.name("qwen2_5_omni")
    choose(app, new_client(app), models.name("qwen2_vl"))
    reply, _ = answer(ask(new_client(app), "Hello?", model_name=omni))
    assert models.registry.loaded == [omni]
    with models.registry.use(omni) as session:
        expected = mlxvlm.generate(session.model, session.processor,
                                   [{"role": "user", "content": "Hello?"}], max_tokens=24)
    assert reply == expected.text


@pytest.mark.parametrize("kind", ["audio", "video"])
def test_an_upload_reaches_the_omni_models_audio_or_video_path(live, kind, tmp_path,
                                                               monkeypatch):
    app, models = live
    omni = models.name("qwen2_5_omni")
    client = new_client(app)
    choose(app, client, omni)
    if kind == "audio":
        media = write_audio(tmp_path / "sound.wav", sine(1.0, 16000, 440.0), 16000)
    else:
        media = write_video(tmp_path / "clip.mp4", coloured_frames(8, 64, 48, seed=4), fps=4)
    seen = seen_inputs(monkeypatch)
    reply, _ = answer(ask(client, "What is it?", media, model_name=omni))

    features = {"audio": "input_features", "video": "pixel_values_videos"}[kind]
    ((_, inputs),) = seen
    assert features in inputs.features
    assert (inputs.num_audios, inputs.num_videos) == ((1, 0) if kind == "audio" else (0, 1))
    with models.registry.use(omni) as session:
        expected = mlxvlm.generate(session.model, session.processor,
                                   [message(kind, media, "What is it?")], max_tokens=24)
        without = mlxvlm.generate(session.model, session.processor,
                                  [{"role": "user", "content": "What is it?"}], max_tokens=24)
    assert reply == expected.text
    assert reply != without.text  # the model heard (or saw) it


def test_browser_picks_the_omni_model_and_its_microphone_recording_is_answered(
    live, tmp_path, monkeypatch
):
    """In headless Chromium with a fake microphone playing a sine: the microphone shows
    once the omni model is picked; the recording (a WAV upload) is answered as
    ``mlxvlm.generate`` answers that file."""
    app, models = live
    omni = models.name("qwen2_5_omni")
    choose(app, new_client(app), models.name("qwen2_vl"))
    fake_microphone = write_audio(tmp_path / "microphone.wav", sine(2.0, 16000, 440.0), 16000)
    seen = seen_inputs(monkeypatch)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=chromium_path(),
            args=CHROMIUM_ARGS + ["--use-fake-device-for-media-stream",
                                  "--use-fake-ui-for-media-stream",
                                  f"--use-file-for-fake-audio-capture={fake_microphone}"],
        )
        try:
            origin = app.local_url.rstrip("/")
            browser.grant_permissions(["microphone", "clipboard-read", "clipboard-write"],
                                      origin=origin)
            page = browser.new_page()
            page.set_default_timeout(WAIT_S * 1000)
            page.goto(app.local_url)
            microphone = page.locator('#message button[aria-label="Record audio"]')
            expect(microphone).to_have_count(0)  # Qwen2-VL does not hear

            page.locator("#model-picker input").click()
            page.get_by_role("option", name="qwen2_5_omni-hub").click()
            expect(page.locator("#model-panel")).to_contain_text("qwen2_5_omni")
            # The figures panel shows the model's previous answer's figures while this
            # one is prepared and streamed: this answer is complete once the model's
            # figures are new and the page shows them.
            with models.registry.use(omni) as omni_session:
                earlier = omni_session.last_stats
            microphone.click()
            page.locator('#message button[aria-label="Start recording"]').click()
            expect(page.locator("#message .timestamp")).not_to_have_text("0:00")
            page.locator('#message button[aria-label="Stop recording"]').click()
            page.locator('#message button[aria-label="Attach audio"]').click()
            # Choosing the model set the controls to its generation_config.json; set the
            # budget only now, so that the reset cannot land after it (it did, 1 run in 3).
            max_tokens = page.locator("#max-tokens input[type=number]")
            max_tokens.fill("24")
            max_tokens.press("Enter")
            expect(max_tokens).to_have_value("24")
            textbox = page.locator("#message textarea")
            textbox.fill("What do you hear?")
            textbox.press("Enter")
            deadline = time.monotonic() + WAIT_S
            while omni_session.last_stats is earlier and time.monotonic() < deadline:
                time.sleep(0.05)
            figures = omni_session.last_stats
            assert figures is not earlier, "the answer did not finish"
            expect(page.locator("#answer-stats")).to_contain_text(
                f"{figures.prompt_tokens} ({figures.reused_tokens} reused)")
            page.locator('#chat button[aria-label="Copy message"]').last.click()
            shown = page.evaluate("navigator.clipboard.readText()")
        finally:
            browser.close()

    assert models.registry.loaded == [omni]
    ((messages, inputs),) = seen
    assert "input_features" in inputs.features and inputs.num_audios == 1
    recording = Path(messages[0]["content"][0]["audio"])
    assert recording.suffix == ".wav" and recording.is_relative_to(process_uploads().directory)
    with models.registry.use(omni) as session:
        expected = mlxvlm.generate(session.model, session.processor,
                                   [message("audio", recording, "What do you hear?")],
                                   max_tokens=24)
    assert shown == expected.text


@pytest.mark.parametrize("family", ["gemma3n", "gemma4", "qwen3_omni_moe"])
def test_the_other_hearing_families_take_a_sound_through_the_chat(tiny_checkpoints, family,
                                                                 tmp_path, monkeypatch):
    """Through the chat's own function (no page): each family that hears gets the sound
    into its audio features, answered as ``mlxvlm.generate`` answers it."""
    model, processor = mlxvlm.load(tiny_checkpoints.path(family, "hub"))
    session = ChatSession(model, processor, family).start()
    try:
        assert "audio" in [kind.name for kind in session.kinds]
        sound = write_audio(tmp_path / "sound.wav", sine(1.0, 16000, 500.0), 16000)
        seen = seen_inputs(monkeypatch)
        turn = {"text": "What is it?", "files": [{"path": str(sound), "mime_type": "audio/wav"}]}
        *_, (reply, _) = session.respond(turn, [], max_tokens=16)
        ((_, inputs),) = seen
        assert "input_features" in inputs.features and inputs.num_audios == 1
        expected = mlxvlm.generate(model, processor, [message("audio", sound, "What is it?")],
                                   max_tokens=16)
        assert reply == expected.text
    finally:
        session.close()
