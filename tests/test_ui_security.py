"""The chat UI reads, copies and serves only files uploaded through it, each only in the
conversation that sent it (tiny Qwen2-VL checkpoint, a live app on 127.0.0.1).

The attacks go over raw HTTP, as gradio_client uploads any local path it is given (on
one machine that is a genuine upload): a client names a server path, a URL or another
client's upload in every input of every event the page has, and in the event data. Each
one must get Gradio's bare error (the same whatever the path, so nothing about the host
is learnt), leave the upload folder as it was (no copy, no download), answer nothing
from the model and leave nothing new downloadable through ``/gradio_api/file=``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from gradio_client import Client, handle_file

import mlxvlm
from mlxvlm.ui.app import build_app, upload_media_options
from mlxvlm.ui.session import ChatSession
from mlxvlm.ui.uploads import process_uploads
from test_ui import WAIT_S, free_port
from tiny import make_image

FILE_META = {"_type": "gradio.FileData"}
# system, temperature, top_p, max_tokens, repetition_penalty, seed, model (None: the first)
SETTINGS = ["", 0.0, 1.0, 8, 1.0, -1, None]
BARE_ERROR = {"error": None}  # what Gradio tells a client about a hidden exception


class Page:
    """A live app spoken to in raw HTTP, as the browser's client does."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=WAIT_S)
        config = self.http.get(f"{self.url}/config").json()
        self.types = {c["id"]: c["type"] for c in config["components"]}
        self.dependencies = config["dependencies"]

    def upload(self, path: Path) -> str:
        with path.open("rb") as f:
            response = self.http.post(
                f"{self.url}/gradio_api/upload", files={"files": (path.name, f, "image/png")}
            )
        response.raise_for_status()
        return response.json()[0]

    def call(self, fn_index: int, data: list, session: str, event_data: Any = None) -> dict:
        """Run event ``fn_index`` through the queue; its final message."""
        dependency = self.dependencies[fn_index]
        body = {"data": data, "fn_index": fn_index, "session_hash": session,
                "event_data": event_data, "trigger_id": (dependency["targets"][0][0] or None)}
        if not dependency["queue"]:
            # Answered at once, in the shape of the queue's last message.
            response = self.http.post(f"{self.url}/gradio_api/run/predict", json=body)
            return {"success": response.status_code == 200, "output": response.json()}
        self.http.post(f"{self.url}/gradio_api/queue/join", json=body).raise_for_status()
        with self.http.stream(
            "GET", f"{self.url}/gradio_api/queue/data", params={"session_hash": session}
        ) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    message = json.loads(line[6:])
                    if message.get("msg") == "process_completed":
                        return message
        raise AssertionError("the queue closed without completing the event")

    def download(self, path: str) -> httpx.Response:
        return self.http.get(f"{self.url}/gradio_api/file={path}")


@pytest.fixture(scope="module")
def live(tiny_checkpoints):
    model, processor = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))
    session = ChatSession(
        model, processor, "tiny-qwen2-vl", media_options=upload_media_options()
    ).start()
    app = build_app(session).queue()
    app.launch(
        server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True
    )
    try:
        yield Page(app.local_url)
    finally:
        app.close()
        session.close()


@pytest.fixture
def named_paths(tmp_path, live) -> dict[str, str]:
    """Files a client may name without uploading them: each kind the app must refuse."""
    uploads = process_uploads().directory
    secret = tmp_path / "secret.png"
    make_image(40, 40, seed=7).save(secret)
    notes = tmp_path / "notes.txt"
    notes.write_text("not for the chat")
    # In the upload folder, but not uploaded: a symlink out, and a file placed there.
    planted = uploads / f"planted-{secrets.token_hex(4)}"
    planted.mkdir()
    link = planted / "link.png"
    link.symlink_to(secret)
    placed = planted / "placed.png"
    shutil.copy(secret, placed)
    # Gradio's default folder, shared with every Gradio app on the host.
    shared = Path(tempfile.gettempdir()) / "gradio" / f"mlxvlm-test-{secrets.token_hex(4)}"
    shared.mkdir(parents=True)
    other_app = shared / "other.png"
    shutil.copy(secret, other_app)
    uploaded = live.upload(secret)  # for the URL below
    yield {
        "image": str(secret),
        "non-image": str(notes),
        "missing": str(tmp_path / "missing.png"),
        "traversal": f"{uploads}/../{os.path.relpath(secret, uploads.parent)}",
        "symlink": str(link),
        "not uploaded, in the upload folder": str(placed),
        "in Gradio's shared folder": str(other_app),
        "public URL": "http://example.com/cat.png",
        "local URL": f"{live.url}/gradio_api/file={uploaded}",
    }
    shutil.rmtree(planted)
    shutil.rmtree(shared)


def folder_listing() -> set[str]:
    root = process_uploads().directory
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def inputs_naming(live: Page, fn_index: int, path: str, meta: bool = True) -> list | None:
    """The event's inputs with ``path`` in every field that holds files; None when none
    does (state inputs are the server's, not the client's)."""
    file = {"path": path, "meta": FILE_META} if meta else {"path": path}
    by_type = {
        "multimodaltextbox": {"text": "What is this?", "files": [file]},
        "chatbot": [
            {"role": "user", "content": [{"type": "file", "file": file}]},
            {"role": "user", "content": [{"type": "component", "component": "image",
                                          "value": file, "constructor_args": {}}]},
        ],
        "browserstate": [{"conversation": [file]}],
        "textbox": file,
        "slider": file,
        "number": file,
    }
    types = [live.types[i] for i in live.dependencies[fn_index]["inputs"]]
    if not any(t in by_type for t in types):
        return None
    return [by_type.get(t) for t in types]


def assert_refused(result: dict, what: str) -> None:
    assert result.get("success") is False, f"{what}: accepted: {str(result)[:400]}"
    output = result.get("output", result)
    assert {k: output.get(k) for k in BARE_ERROR} == BARE_ERROR, f"{what}: {output}"


def test_every_event_refuses_every_named_file_alike(live, named_paths):
    events = [i for i in range(len(live.dependencies)) if inputs_naming(live, i, "x")]
    # The chat endpoint, the page's submit / retry / option chains, the chatbot syncs...
    assert 6 in events and 0 in events and len(events) >= 10, events
    before = folder_listing()
    for what, path in named_paths.items():
        for meta in (True, False):
            for fn_index in events:
                name = live.dependencies[fn_index]["api_name"]
                data = inputs_naming(live, fn_index, path, meta)
                result = live.call(fn_index, data, f"attacker-{fn_index}-{meta}")
                if not meta and result.get("success"):
                    # Without Gradio's file marker a value is not a file: nothing read.
                    assert path not in json.dumps(result.get("output", {}).get("data")) or (
                        live.types[live.dependencies[fn_index]["outputs"][0]] != "json"
                    )
                    continue
                assert_refused(result, f"{what} via {name} (meta={meta})")
    assert folder_listing() == before, "a named file was copied or downloaded"
    for path in named_paths.values():
        if not path.startswith("http") and not path.startswith(str(process_uploads().directory)):
            assert live.download(path).status_code == 403


def event_named(live: Page, api_name: str) -> int:
    return next(i for i, d in enumerate(live.dependencies) if d["api_name"] == api_name)


def message(path: str, text: str = "What is it?") -> dict:
    return {"text": text, "files": [{"path": path, "meta": FILE_META}]}


def test_another_conversations_upload_is_never_read(live, tmp_path):
    """An upload's path reaches only its uploader, but a path can leak (a log, a shared
    screen): the conversations that did not send it first cannot use it."""
    picture = tmp_path / "theirs.png"
    make_image(40, 40, seed=5).save(picture)
    theirs = live.upload(picture)
    assert live.call(6, [message(theirs), None, *SETTINGS], "owner")["success"]
    before = folder_listing()

    # The chat endpoint.
    assert_refused(live.call(6, [message(theirs), None, *SETTINGS], "thief-1"), "/chat")
    # The page's own chain: the textbox is saved, then answered from the saved message.
    save, answer = event_named(live, "_clear_and_save_textbox"), event_named(live, "_submit_fn")
    assert live.call(save, [message(theirs)], "thief-2")["success"]  # only stored
    assert_refused(live.call(answer, [None, None, *SETTINGS], "thief-2"), "_submit_fn")
    # A forged history, synced into the conversation's state, then a text-only turn.
    sync = event_named(live, "lambda")
    history = [{"role": "user", "content": [{"type": "file", "file": {
        "path": theirs, "meta": FILE_META}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]}]
    assert live.call(sync, [history], "thief-3")["success"]  # only stored
    assert_refused(
        live.call(6, [{"text": "Describe it again.", "files": []}, None, *SETTINGS],
                  "thief-3"),
        "a forged history",
    )
    assert folder_listing() == before


def test_a_chat_history_cannot_carry_a_component(live, named_paths):
    """Gradio builds the component a history message names and preprocesses the value:
    ``gr.Image`` would open the path and re-encode it into the upload folder."""
    events = [i for i, d in enumerate(live.dependencies)
              if "chatbot" in [live.types[c] for c in d["inputs"]]]
    assert len(events) >= 5, events
    before = folder_listing()
    for fn_index in events:
        for meta in (False, True):
            value = {"path": named_paths["image"], **({"meta": FILE_META} if meta else {})}
            history = [{"role": "user", "content": [
                {"type": "component", "component": "image", "value": value,
                 "constructor_args": {}, "props": {}}]}]
            data = [history if live.types[c] == "chatbot" else None
                    for c in live.dependencies[fn_index]["inputs"]]
            result = live.call(fn_index, data, f"component-{fn_index}-{meta}")
            assert_refused(result, f"{live.dependencies[fn_index]['api_name']} (meta={meta})")
    assert folder_listing() == before, "an image named in a component was re-encoded"


def test_the_event_data_cannot_name_a_file(live, named_paths):
    option_select = event_named(live, "option_clicked")
    before = folder_listing()
    for what, path in named_paths.items():
        result = live.call(
            option_select, [[]], f"attacker-option-{what}",
            event_data={"index": 0, "value": {"path": path, "meta": FILE_META}},
        )
        assert result.get("success") is False, what
    assert folder_listing() == before


def test_an_upload_is_answered_in_its_own_conversation_only(live, tmp_path):
    picture = tmp_path / "picture.png"
    make_image(48, 48, seed=11).save(picture)
    client = Client(live.url, verbose=False)
    reply, stats = client.predict(
        {"text": "What is in the picture?", "files": [handle_file(str(picture))]},
        *SETTINGS, api_name="/chat",
    )
    assert isinstance(reply, str) and reply and "prompt tokens" in stats
    # A follow-up keeps the picture (its history is this conversation's).
    reply, _ = client.predict({"text": "And its colour?", "files": []}, *SETTINGS,
                              api_name="/chat")
    assert isinstance(reply, str) and reply

    # The same bytes uploaded again by someone else are theirs to use too.
    mine = live.upload(picture)
    result = live.call(6, [{"text": "What is it?", "files": [
        {"path": mine, "meta": FILE_META}]}, None, *SETTINGS], "second-user")
    assert result["success"] and isinstance(result["output"]["data"][0], str)
    # ... but only by them: one upload, one conversation.
    result = live.call(6, [{"text": "What is it?", "files": [
        {"path": mine, "meta": FILE_META}]}, None, *SETTINGS], "third-user")
    assert_refused(result, "an upload taken by another conversation")
    # The uploader's copy is what the page shows, and stays downloadable by them.
    assert live.download(mine).content == picture.read_bytes()


def test_a_conversation_that_chose_a_model_still_refuses_named_files(live, named_paths):
    """Choosing a model updates the attachment box and the sliders: Gradio then gives the
    conversation new instances of them, which must refuse named files as the page's do."""
    choose, chat = event_named(live, "choose_model"), event_named(live, "chat")
    before = folder_listing()
    for what, path in named_paths.items():
        session = f"chooser-{secrets.token_hex(4)}"
        assert live.call(choose, ["tiny-qwen2-vl"], session)["success"]
        assert_refused(live.call(chat, [message(path), None, *SETTINGS], session), what)
    assert folder_listing() == before
