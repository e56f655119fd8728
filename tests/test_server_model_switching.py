"""Two models behind one slot (``--model A --model B``, ``--max-loaded-models 1``) through
the real entry point, ``python -m mlxvlm.server``: requests for both at once are all
answered as one-model servers answer them, each load serves requests that wait for it (no
load/unload loop), a model in steady use does not starve the other, clients that give up
while waiting cause no load, and too many waiting for one model are refused with 429."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from server_harness import LiveServer, wait_until
from server_process import ServerProcess

import mlxvlm

HELLO = [{"role": "user", "content": "Describe a garden with a house."}]
GREEDY = {"temperature": 0, "max_tokens": 16}


@pytest.fixture(scope="module")
def paths(tiny_checkpoints):
    return (str(tiny_checkpoints.path("qwen2_vl", "hub")),
            str(tiny_checkpoints.path("qwen2_5_vl", "hub")))


@pytest.fixture(scope="module")
def reference(paths):
    """Each model's answer from an in-process server of that model alone."""
    answers = {}
    for path in paths:
        with LiveServer(*mlxvlm.load(path), model_id=path) as server:
            answers[path] = ask(server.base_url, path)
    assert len(set(answers.values())) == 2  # an answer by the wrong model would show
    return answers


def ask(base_url: str, model: str, timeout: float = 120.0) -> str:
    response = httpx.post(f"{base_url}/v1/chat/completions", timeout=timeout,
                          json={"model": model, "messages": HELLO, **GREEDY})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response.json()["choices"][0]["message"]["content"]


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    (value,) = re.findall(rf"^{name} (\S+)$", text, re.M)
    return float(value)


def loads_in(log: str) -> list[tuple[str, int]]:
    """Each load the server logged: (model, the requests waiting for it)."""
    return [(model, int(n)) for model, n in
            re.findall(r"loading '([^']+)' from \S+ for (\d+) waiting requests", log)]


def test_both_models_at_once_are_answered_without_starving_either(paths, reference):
    a, b = paths
    with ServerProcess("--model", a, "--model", b, "--min-loaded-seconds", "1") as server:
        url = server.base_url
        b_done = threading.Event()
        answers: dict[str, list[str]] = {a: [], b: []}
        failures: list[BaseException] = []

        def keep_asking_a() -> None:  # a steady stream for the loaded model
            deadline = time.monotonic() + 120
            try:
                while not b_done.is_set() and time.monotonic() < deadline:
                    answers[a].append(ask(url, a))
            except BaseException as error:  # noqa: BLE001 -- reported below
                failures.append(error)

        def ask_b_twice() -> None:
            try:
                for _ in range(2):
                    answers[b].append(ask(url, b))
            except BaseException as error:  # noqa: BLE001
                failures.append(error)

        steady = [threading.Thread(target=keep_asking_a) for _ in range(2)]
        for thread in steady:
            thread.start()
        asking_b = [threading.Thread(target=ask_b_twice) for _ in range(3)]
        for thread in asking_b:
            thread.start()
        for thread in asking_b:
            thread.join(150)
        # B was answered while A was still asked for: A's use did not starve it.
        b_done.set()
        for thread in steady:
            thread.join(150)
        assert not failures, failures
        assert answers[b] == [reference[b]] * 6
        assert answers[a] and set(answers[a]) == {reference[a]}
        # Each load was made for requests waiting for it (none came in a loop): B was
        # loaded at most once per request for it, A back at most once after each.
        loads = loads_in(server.log())
        assert loads and all(waiting >= 1 for _, waiting in loads)
        loads_of_b = sum(model == b for model, _ in loads)
        assert 1 <= loads_of_b <= 6 and len(loads) - loads_of_b <= loads_of_b
        assert metric(url, "mlxvlm_model_loads_total") == len(loads) + 1  # + the first
        # Nobody waits any more, and nothing loads (the old loop went on after its
        # clients were gone).
        assert metric(url, "mlxvlm_model_waiting_requests") == 0
        time.sleep(1.5)
        assert len(loads_in(server.log())) == len(loads)


def test_clients_that_leave_while_waiting_cause_no_load(paths, reference):
    a, b = paths
    # B is loaded first and kept in use by a steady bystander: A's requests wait for
    # B's turn (longer than this test), and their clients give up first.
    with ServerProcess("--model", b, "--model", a, "--min-loaded-seconds", "300",
                       "--max-concurrency", "1", "--max-queue", "1") as server:
        url = server.base_url
        stop = threading.Event()
        bystander_answers: list[str] = []
        failures: list[BaseException] = []

        def keep_asking_b() -> None:
            try:
                while not stop.is_set():
                    bystander_answers.append(ask(url, b))
            except BaseException as error:  # noqa: BLE001 -- reported below
                failures.append(error)

        outcomes: list[object] = []

        def ask_a_briefly() -> None:
            try:
                response = httpx.post(f"{url}/v1/chat/completions", timeout=1.0,
                                      json={"model": a, "messages": HELLO, **GREEDY})
                outcomes.append(response)
            except httpx.TimeoutException:
                outcomes.append("gave up")

        # Two in a row, so that B is never idle for a second (it would then give way).
        bystanders = [threading.Thread(target=keep_asking_b) for _ in range(2)]
        for thread in bystanders:
            thread.start()
        assert wait_until(lambda: len(bystander_answers) >= 2, 60)
        impatient = [threading.Thread(target=ask_a_briefly) for _ in range(3)]
        for thread in impatient:
            thread.start()
        for thread in impatient:
            thread.join(30)
        # Two wait (max-concurrency + max-queue), the third is refused at once.
        refused = [o for o in outcomes if isinstance(o, httpx.Response)]
        assert outcomes.count("gave up") == 2 and len(refused) == 1
        assert refused[0].status_code == 429
        assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
        assert refused[0].headers["retry-after"] == "1"
        assert metric(url, "mlxvlm_model_waits_refused_total") == 1
        assert wait_until(lambda: metric(url, "mlxvlm_model_waits_abandoned_total") == 2, 30,
                          interval=0.1)
        assert metric(url, "mlxvlm_model_waiting_requests") == 0
        stop.set()
        for thread in bystanders:
            thread.join(60)
        assert not failures, failures
        assert set(bystander_answers) == {reference[b]}
        # B is idle now, and would give way at once to anyone waiting: nobody does.
        time.sleep(2.5)
        assert metric(url, "mlxvlm_model_loads_total") == 1
        assert loads_in(server.log()) == []
        # A later request for A is answered: idle, B gives way.
        assert ask(url, a) == reference[a]
        assert loads_in(server.log()) == [(a, 1)]

