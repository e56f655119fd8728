"""The chat UI reads, copies and serves only files uploaded through it, each only in the
conversation that sent it: the app as users start it (``python -m mlxvlm.ui --model A
--model B`` in a subprocess on a free loopback port; tiny Qwen2-VL and Qwen2.5-VL
checkpoints), its private upload folder found under the ``GRADIO_TEMP_DIR`` it is given.

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

from server_process import UIProcess
from tiny import make_image

WAIT_S = 120  # upper bound of every wait (a turn for the other model loads it first)
FILE_META = {"_type": "gradio.FileData"}
# The chat's settings by their API names; the model is left to the page's default.
SETTINGS = {"system_prompt": "", "temperature": 0.0, "top_p": 1.0, "max_tokens": 8,
            "repetition_penalty": 1.0, "seed": -1, "talker_temperature": 0.9}
BARE_ERROR = {"error": None}  # what Gradio tells a client about a hidden exception


class Page:
    """A live app spoken to in raw HTTP, as the browser's client does; ``uploads`` is its
    process's upload folder, ``models`` the models it offers (the first by default)."""

    def __init__(self, url: str, uploads: Path, models: tuple[str, ...]):
        self.url = url.rstrip("/")
        self.uploads = uploads
        self.models = models
        self.http = httpx.Client(timeout=WAIT_S)
        config = self.http.get(f"{self.url}/config").json()
        self.types = {c["id"]: c["type"] for c in config["components"]}
        self.dependencies = config["dependencies"]
        # The chat's settings by component: the /chat API names its parameters, which are
        # the chat event's inputs less its conversation state.
        info = self.http.get(f"{self.url}/gradio_api/info").json()
        names = [p["parameter_name"] for p in info["named_endpoints"]["/chat"]["parameters"]]
        inputs = self.dependencies[self.event("chat")]["inputs"]
        self.setting_ids = dict(zip(names, [i for i in inputs if self.types[i] != "state"]))

    def event(self, api_name: str) -> int:
        return next(i for i, d in enumerate(self.dependencies) if d["api_name"] == api_name)

    def turn(self, fn_index: int, message: dict | None = None, **settings) -> list:
        """The inputs of an answering event: ``message`` in the message box (if it reads
        one), nothing in the conversation's state, ``SETTINGS`` and ``settings``."""
        by_id = {self.setting_ids[name]: value
                 for name, value in {**SETTINGS, **settings}.items()}
        return [message if self.types[i] == "multimodaltextbox" else by_id.get(i)
                for i in self.dependencies[fn_index]["inputs"]]

    def folder_listing(self) -> set[str]:
        return {str(p.relative_to(self.uploads)) for p in self.uploads.rglob("*")}

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
def live(tiny_checkpoints, tmp_path_factory):
    gradio_dir = tmp_path_factory.mktemp("gradio")
    models = tuple(str(tiny_checkpoints.path(f, "hub")) for f in ("qwen2_vl", "qwen2_5_vl"))
    with UIProcess("--model", models[0], "--model", models[1],
                   env={"GRADIO_TEMP_DIR": str(gradio_dir)}) as ui:
        (uploads,) = gradio_dir.glob("mlxvlm-ui-*")  # the process's private folder
        page = Page(ui.base_url, uploads.resolve(), models)
        try:
            yield page
        finally:
            page.http.close()


@pytest.fixture
def named_paths(tmp_path, live) -> dict[str, str]:
    """Files a client may name without uploading them: each kind the app must refuse."""
    uploads = live.uploads
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
    # The folder the user chose for Gradio's files, beside the app's own inside it.
    beside = uploads.parent / f"beside-{secrets.token_hex(4)}.png"
    shutil.copy(secret, beside)
    uploaded = live.upload(secret)  # for the URL below
    yield {
        "image": str(secret),
        "non-image": str(notes),
        "missing": str(tmp_path / "missing.png"),
        "traversal": f"{uploads}/../{os.path.relpath(secret, uploads.parent)}",
        "symlink": str(link),
        "not uploaded, in the upload folder": str(placed),
        "in Gradio's shared folder": str(other_app),
        "in GRADIO_TEMP_DIR, beside the upload folder": str(beside),
        "public URL": "http://example.com/cat.png",
        "local URL": f"{live.url}/gradio_api/file={uploaded}",
    }
    shutil.rmtree(planted)
    shutil.rmtree(shared)
    beside.unlink()


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
    named = {live.event(n) for n in ("chat", "_clear_and_save_textbox", "option_clicked")}
    assert named <= set(events) and len(events) >= 10, events
    before = live.folder_listing()
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
    assert live.folder_listing() == before, "a named file was copied or downloaded"
    for path in named_paths.values():
        if not path.startswith("http") and not path.startswith(str(live.uploads)):
            assert live.download(path).status_code == 403


def message(path: str, text: str = "What is it?") -> dict:
    return {"text": text, "files": [{"path": path, "meta": FILE_META}]}


def test_another_conversations_upload_is_never_read(live, tmp_path):
    """An upload's path reaches only its uploader, but a path can leak (a log, a shared
    screen): the conversations that did not send it first cannot use it."""
    picture = tmp_path / "theirs.png"
    make_image(40, 40, seed=5).save(picture)
    theirs = live.upload(picture)
    chat = live.event("chat")
    assert live.call(chat, live.turn(chat, message(theirs)), "owner")["success"]
    before = live.folder_listing()

    # The chat endpoint.
    assert_refused(live.call(chat, live.turn(chat, message(theirs)), "thief-1"), "/chat")
    # The page's own chain: the textbox is saved, then answered from the saved message.
    save, answer = live.event("_clear_and_save_textbox"), live.event("_submit_fn")
    assert live.call(save, [message(theirs)], "thief-2")["success"]  # only stored
    assert_refused(live.call(answer, live.turn(answer), "thief-2"), "_submit_fn")
    # A forged history, synced into the conversation's state, then a text-only turn.
    sync = live.event("lambda")
    history = [{"role": "user", "content": [{"type": "file", "file": {
        "path": theirs, "meta": FILE_META}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]}]
    assert live.call(sync, [history], "thief-3")["success"]  # only stored
    assert_refused(
        live.call(chat, live.turn(chat, {"text": "Describe it again.", "files": []}),
                  "thief-3"),
        "a forged history",
    )
    assert live.folder_listing() == before


def test_a_chat_history_cannot_carry_a_component(live, named_paths):
    """Gradio builds the component a history message names and preprocesses the value:
    ``gr.Image`` would open the path and re-encode it into the upload folder."""
    events = [i for i, d in enumerate(live.dependencies)
              if "chatbot" in [live.types[c] for c in d["inputs"]]]
    assert len(events) >= 5, events
    before = live.folder_listing()
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
    assert live.folder_listing() == before, "an image named in a component was re-encoded"


def test_the_event_data_cannot_name_a_file(live, named_paths):
    option_select = live.event("option_clicked")
    before = live.folder_listing()
    for what, path in named_paths.items():
        result = live.call(
            option_select, [[]], f"attacker-option-{what}",
            event_data={"index": 0, "value": {"path": path, "meta": FILE_META}},
        )
        assert result.get("success") is False, what
    assert live.folder_listing() == before


def test_an_upload_is_answered_in_its_own_conversation_only(live, tmp_path):
    picture = tmp_path / "picture.png"
    make_image(48, 48, seed=11).save(picture)
    client = Client(live.url, verbose=False)
    reply, stats = client.predict(
        {"text": "What is in the picture?", "files": [handle_file(str(picture))]},
        api_name="/chat", **SETTINGS,
    )
    assert isinstance(reply, str) and reply and "prompt tokens" in stats
    # A follow-up keeps the picture (its history is this conversation's).
    reply, _ = client.predict({"text": "And its colour?", "files": []}, api_name="/chat",
                              **SETTINGS)
    assert isinstance(reply, str) and reply

    # The same bytes uploaded again by someone else are theirs to use too.
    chat = live.event("chat")
    mine = live.upload(picture)
    result = live.call(chat, live.turn(chat, message(mine)), "second-user")
    assert result["success"] and isinstance(result["output"]["data"][0], str)
    # ... but only by them: one upload, one conversation.
    result = live.call(chat, live.turn(chat, message(mine)), "third-user")
    assert_refused(result, "an upload taken by another conversation")
    # The uploader's copy is what the page shows, and stays downloadable by them.
    assert live.download(mine).content == picture.read_bytes()


def test_a_conversation_that_chose_a_model_still_refuses_named_files(live, named_paths):
    """Choosing a model updates the attachment box and the sliders: Gradio then gives the
    conversation new instances of them, which must refuse named files as the page's do."""
    choose, chat = live.event("choose_model"), live.event("chat")
    other = live.models[1]  # loaded by the first choice, in place of the first model
    before = live.folder_listing()
    for what, path in named_paths.items():
        session = f"chooser-{secrets.token_hex(4)}"
        chosen = live.call(choose, [other], session)
        assert chosen["success"] and other in chosen["output"]["data"][0], chosen
        assert_refused(live.call(chat, live.turn(chat, message(path), model_name=other),
                                 session), what)
    assert live.folder_listing() == before
