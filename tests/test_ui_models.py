"""The chat's model picker and the media each model takes (tiny checkpoints, a live app on
127.0.0.1): choosing a model loads it and unloads the other, the message box offers what
the chosen model takes (the microphone for a model that hears), and an uploaded or
recorded sound reaches Qwen2.5-Omni's audio features, a video its video path, each
answered as ``mlxvlm.generate`` answers it."""

from __future__ import annotations

from pathlib import Path

import pytest

import mlxvlm
from mlxvlm.ui import session as session_module
from mlxvlm.ui.app import build_app, upload_media_options
from mlxvlm.ui.models import ModelRegistry
from mlxvlm.ui.session import ChatSession
from av_media import coloured_frames, sine, write_audio, write_video

pytest.importorskip("gradio_client")
from test_ui import LiveApp, answer, ask, free_port  # noqa: E402

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
        close = session.close

        def logged_close():
            self.closed.append(self.paths[name])
            close()

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
    """The prepared inputs of every turn from now on."""
    seen = []
    prepare = session_module.prepare_inputs

    def spy(*args, **kwargs):
        seen.append(prepare(*args, **kwargs))
        return seen[-1]

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
    assert (box.sources, box.file_types) == (["upload"], ["image", "video"])
    first, _ = answer(ask(client, "Hello?"))

    box = choose(app, client, omni)
    assert models.registry.loaded == [omni] and models.closed == ["qwen2_vl"]
    assert box.sources == ["upload", "microphone"]
    assert box.file_types == ["image", "video", "audio"]
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
    (inputs,) = seen
    assert features in inputs.features
    assert (inputs.num_audios, inputs.num_videos) == ((1, 0) if kind == "audio" else (0, 1))
    with models.registry.use(omni) as session:
        expected = mlxvlm.generate(session.model, session.processor,
                                   [message(kind, media, "What is it?")], max_tokens=24)
        without = mlxvlm.generate(session.model, session.processor,
                                  [{"role": "user", "content": "What is it?"}], max_tokens=24)
    assert reply == expected.text
    assert reply != without.text  # the model heard (or saw) it
