"""Conversations on two models at once in the chat UI as users start it (``python -m
mlxvlm.ui --model A --model B``, one model loaded at a time; tiny Qwen2-VL and Qwen2.5-VL
checkpoints), each conversation a ``gradio_client.Client``: every answer is the one
``mlxvlm.generate`` gives on that model alone, each load is made for turns waiting for it
and serves all of them (no load/unload loop), a conversation whose client leaves while it
waits causes no load, and a turn naming a file it did not upload is refused before its
model would load."""

from __future__ import annotations

import json
import re
import secrets
import threading
import time

import httpx
import pytest
from gradio_client import Client

import mlxvlm
from server_harness import wait_until
from server_process import UIProcess
from test_ui_security import Page, assert_refused, message
from tiny import make_image

WAIT_S = 120
QUESTIONS = ["Describe a garden with a house.", "And the sky?"]
GREEDY = {"system_prompt": "", "temperature": 0.0, "top_p": 1.0, "max_tokens": 16,
          "repetition_penalty": 1.0, "seed": -1}


@pytest.fixture(scope="module")
def paths(tiny_checkpoints):
    return (str(tiny_checkpoints.path("qwen2_vl", "hub")),
            str(tiny_checkpoints.path("qwen2_5_vl", "hub")))


@pytest.fixture(scope="module")
def reference(paths):
    """Each model's answers to the two turns of one conversation, from ``mlxvlm.generate``
    on that model alone."""
    answers = {}
    for path in paths:
        model, processor = mlxvlm.load(path)
        messages, replies = [], []
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            replies.append(mlxvlm.generate(model, processor, messages, max_tokens=16,
                                           temperature=0.0).text)
            messages.append({"role": "assistant", "content": replies[-1]})
        answers[path] = replies
    assert answers[paths[0]] != answers[paths[1]]  # an answer by the wrong model would show
    return answers


@pytest.fixture(scope="module")
def ui(paths, tmp_path_factory):
    """The UI offering B first, then A; a model in use keeps its place longer than these
    tests (one idle for a second gives way at once)."""
    a, b = paths
    gradio_dir = tmp_path_factory.mktemp("gradio")
    with UIProcess("--model", b, "--model", a, "--min-loaded-seconds", "300",
                   env={"GRADIO_TEMP_DIR": str(gradio_dir)}) as process:
        (uploads,) = gradio_dir.glob("mlxvlm-ui-*")
        process.page = Page(process.base_url, uploads, (b, a))
        yield process


def loads_in(log: str) -> list[tuple[str, int]]:
    """Each load the UI logged after its start: (model, the turns waiting for it)."""
    return [(model, int(n)) for model, n in
            re.findall(r"loading '([^']+)' from \S+ for (\d+) waiting requests", log)]


def test_conversations_on_two_models_at_once_each_load_serving_all_waiting(ui, paths,
                                                                           reference):
    a, b = paths
    start = len(ui.log())
    chooses = [a, b, a, b, a, b]  # one conversation each, half on the other model
    clients = [Client(ui.base_url, verbose=False) for _ in chooses]
    answers: dict[int, list[str]] = {i: [] for i in range(len(clients))}
    failures: list[BaseException] = []
    start_together = threading.Barrier(len(clients))

    def converse(i: int) -> None:
        try:
            for question in QUESTIONS:  # a round: every conversation's turn at once
                start_together.wait(WAIT_S)
                job = clients[i].submit(question, api_name="/chat", model_name=chooses[i],
                                        **GREEDY)
                answers[i].append(job.result(timeout=WAIT_S)[0])
        except BaseException as error:  # noqa: BLE001 -- reported below
            failures.append(error)
            start_together.abort()

    threads = [threading.Thread(target=converse, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * WAIT_S)
    assert not failures, failures
    assert all(answers[i] == reference[chooses[i]] for i in answers), answers

    # Each load was made for turns waiting for it, and served every turn waiting for
    # that model: in a round, each model loads at most once.
    loads = loads_in(ui.log()[start:])
    assert loads and all(waiting >= 1 for _, waiting in loads), loads
    assert len(loads) <= 2 * len(QUESTIONS), loads
    # Nobody waits any more, and nothing loads (the server's load loop went on after its
    # clients were gone).
    time.sleep(1.5)
    assert loads_in(ui.log()[start:]) == loads


def leave_while_waiting(page: Page, data: list, fn_index: int) -> None:
    """Join the queue as a browser does, read until the turn streams (it waits for its
    model), then go away: the connection closes."""
    session = secrets.token_hex(8)
    body = {"data": data, "fn_index": fn_index, "session_hash": session,
            "event_data": None, "trigger_id": None}
    with httpx.Client(timeout=WAIT_S) as http:
        http.post(f"{page.url}/gradio_api/queue/join", json=body).raise_for_status()
        with http.stream("GET", f"{page.url}/gradio_api/queue/data",
                         params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[len("data: "):])
                    assert event.get("msg") != "process_completed", event
                    if event.get("msg") == "process_generating":
                        return


def test_conversations_that_leave_while_waiting_cause_no_load(ui, paths, reference,
                                                               tmp_path):
    a, b = paths
    page = ui.page
    chat = page.event("chat")
    # B is kept in use by steady conversations: turns for A wait for B's turn (longer
    # than this test), and their clients leave first.
    stop = threading.Event()
    bystander_answers: list[str] = []
    failures: list[BaseException] = []

    def keep_asking_b() -> None:
        client = Client(ui.base_url, verbose=False)
        try:
            while not stop.is_set():
                client.reset_session()  # a new one-turn conversation each time
                bystander_answers.append(client.predict(
                    QUESTIONS[0], api_name="/chat", model_name=b, **GREEDY)[0])
        except BaseException as error:  # noqa: BLE001 -- reported below
            failures.append(error)

    # Three in a row, so that B is never idle for a second (it would then give way).
    bystanders = [threading.Thread(target=keep_asking_b) for _ in range(3)]
    for thread in bystanders:
        thread.start()
    try:
        assert wait_until(lambda: len(bystander_answers) >= 3, WAIT_S)
        start = len(ui.log())  # B is loaded (for the bystanders, if A was)
        for _ in range(3):
            leave_while_waiting(page, page.turn(chat, {"text": QUESTIONS[0], "files": []},
                                                model_name=a), chat)
        assert wait_until(lambda: ui.log()[start:].count(
            f"a conversation left while waiting for {a!r}") == 3, WAIT_S, interval=0.1)
    finally:
        stop.set()
        for thread in bystanders:
            thread.join(WAIT_S)
    assert not failures, failures
    assert set(bystander_answers) == {reference[b][0]}
    # Another conversation's upload, named in a turn for A: refused before the turn
    # waits for A (B, idle now, would give way to it at once and A would load).
    picture = tmp_path / "theirs.png"
    make_image(40, 40, seed=3).save(picture)
    theirs = page.upload(picture)
    assert page.call(chat, page.turn(chat, message(theirs), model_name=b),
                     "owner")["success"]
    assert_refused(page.call(chat, page.turn(chat, message(theirs), model_name=a),
                             "thief"), "another conversation's upload")
    # Nobody waits for A: B stays.
    time.sleep(2.5)
    assert loads_in(ui.log()[start:]) == []
    # A later turn for A is answered: idle, B gives way, and A loads for it alone.
    reply, _ = Client(ui.base_url, verbose=False).predict(
        QUESTIONS[0], api_name="/chat", model_name=a, **GREEDY)
    assert reply == reference[a][0]
    assert loads_in(ui.log()[start:]) == [(a, 1)]
