"""Several models behind one server (``models_registry``), driven by the official
``openai`` and ``anthropic``-shaped clients: a request's ``model`` picks one, loaded on
first use; with ``max_loaded_models`` 1 a switch unloads the other (after its answer, never
during it); answers are those of one-model servers; a model being loaded does not hold up
requests to a loaded one."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from server_harness import LiveServer, wait_until

import mlxvlm
from mlxvlm.errors import MlxvlmError
from mlxvlm.server.config import ServerConfig, build_parser, config_from_args
from mlxvlm.server.models_registry import ModelRegistry

A, B = "tiny-a", "tiny-b"
GREEDY = {"temperature": 0, "max_tokens": 16}
HELLO = [{"role": "user", "content": "Describe a garden with a house."}]


@pytest.fixture(scope="module")
def paths(tiny_checkpoints):
    return {A: str(tiny_checkpoints.path("qwen2_vl", "hub")),
            B: str(tiny_checkpoints.path("qwen2_5_vl", "hub"))}


@pytest.fixture(scope="module")
def one_model_answers(paths):
    """Each model's answer from a server of that model alone."""
    answers = {}
    for model_id, path in paths.items():
        with LiveServer(*mlxvlm.load(path), model_id=model_id) as server:
            answers[model_id] = ask(server.client(), model_id)
    assert answers[A] != answers[B]  # so that a request answered by the wrong one shows
    return answers


class RecordingLoader:
    """``mlxvlm.load`` that counts its calls per model and can hold one model's load
    until the test lets it go."""

    def __init__(self, hold: str | None = None):
        self.calls: list[str] = []
        self.hold = hold
        self.holding = threading.Event()
        self.let_go = threading.Event()

    def __call__(self, model_id: str, path: str):
        self.calls.append(model_id)
        if model_id == self.hold:
            self.holding.set()
            assert self.let_go.wait(60), "the test never let the load go"
        return mlxvlm.load(path)


def registry(paths, loader, **config) -> ModelRegistry:
    config.setdefault("min_loaded_seconds", 0)  # switch as soon as a model's answers are done
    config = ServerConfig(model_id=A, model_sources=paths, **config)
    return ModelRegistry(config, loader)


def ask(client, model_id: str) -> str:
    response = client.chat.completions.create(model=model_id, messages=HELLO, **GREEDY)
    assert response.model == model_id
    return response.choices[0].message.content


def test_switching_with_one_model_loaded_answers_as_one_model_servers(paths, one_model_answers):
    loader = RecordingLoader()
    models = registry(paths, loader, max_loaded_models=1)
    with LiveServer(None, None, registry=models) as server:
        client = server.client()
        assert models.loaded_ids() == []  # loaded on first use
        assert ask(client, A) == one_model_answers[A]
        assert models.loaded_ids() == [A]
        assert ask(client, B) == one_model_answers[B]
        assert models.loaded_ids() == [B]
        assert ask(client, A) == one_model_answers[A]
        assert ask(client, A) == one_model_answers[A]  # loaded: not loaded again
        assert models.loaded_ids() == [A]
        assert loader.calls == [A, B, A]
        assert (models.loads, models.unloads) == (3, 2)
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert "mlxvlm_models_loaded 1" in metrics
        assert 'mlxvlm_generation_tokens_total{model="tiny-a"}' in metrics


def test_models_are_listed_loaded_or_not_and_unknown_ones_are_404(paths):
    models = registry(paths, RecordingLoader(), max_loaded_models=1)
    with LiveServer(None, None, registry=models) as server:
        client = server.client()
        assert [m.id for m in client.models.list()] == [A, B]
        assert client.models.retrieve(B).id == B
        with pytest.raises(openai.NotFoundError) as error:
            client.models.retrieve("gpt-4o")
        assert error.value.body["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError) as error:
            ask(client, "gpt-4o")
        assert error.value.body["code"] == "model_not_found"
        assert "'tiny-a', 'tiny-b'" in error.value.body["message"]
        anthropic = httpx.post(f"{server.base_url}/v1/messages", json={
            "model": "claude-x", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert anthropic.status_code == 404
        assert anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "not_found_error"
        assert models.loaded_ids() == []  # nothing was loaded for them


def test_a_loaded_model_answers_while_another_loads(paths, one_model_answers):
    loader = RecordingLoader(hold=B)
    models = registry(paths, loader, max_loaded_models=2)
    with LiveServer(None, None, registry=models) as server:
        client = server.client()
        assert ask(client, A) == one_model_answers[A]
        answers: dict[int, str] = {}

        def ask_b(n: int) -> None:
            answers[n] = ask(server.client(), B)

        waiting = [threading.Thread(target=ask_b, args=(n,)) for n in range(2)]
        for thread in waiting:
            thread.start()
        assert loader.holding.wait(30)
        # B's load is held: A still answers, and nothing of B is done.
        assert ask(client, A) == one_model_answers[A]
        assert answers == {} and models.loaded_ids() == [A]
        loader.let_go.set()
        for thread in waiting:
            thread.join(60)
        assert answers == {0: one_model_answers[B], 1: one_model_answers[B]}
        assert loader.calls == [A, B]  # the two requests for B waited for one load
        assert sorted(models.loaded_ids()) == [A, B]


def test_a_model_is_unloaded_only_after_its_answer(paths, one_model_answers):
    loader = RecordingLoader()
    models = registry(paths, loader, max_loaded_models=1)
    with LiveServer(None, None, registry=models) as server:
        client = server.client()
        assert ask(client, A) == one_model_answers[A]
        engine = models.service(A).engine
        gate = threading.Event()
        decode_step = engine._decode_step

        def gated_decode_step():
            assert gate.wait(60), "the test never opened the gate"
            decode_step()

        engine._decode_step = gated_decode_step
        stream = client.chat.completions.create(model=A, messages=HELLO, stream=True,
                                                **GREEDY)
        chunks = iter(stream)
        first = next(chunks)  # A's answer has begun, and waits at the gate
        answered_b: list[str] = []
        asking_b = threading.Thread(target=lambda: answered_b.append(ask(server.client(), B)))
        asking_b.start()
        # B's request waits: A keeps its engine until its answer is done, and B is not
        # loaded yet.
        assert wait_until(lambda: models.waiting(B) == 1)
        assert models.loaded_ids() == [A]
        assert loader.calls == [A] and not answered_b
        gate.set()
        text = (first.choices[0].delta.content or "") + "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == one_model_answers[A]
        asking_b.join(60)
        assert answered_b == [one_model_answers[B]]
        assert models.loaded_ids() == [B] and loader.calls == [A, B]


def test_idle_models_are_unloaded(paths):
    now = [0.0]
    config = ServerConfig(model_id=A, model_sources=paths, max_loaded_models=2,
                          idle_unload_seconds=60)
    models = ModelRegistry(config, RecordingLoader(), clock=lambda: now[0])

    async def scenario() -> list:
        lease_a = await models.acquire(A)
        now[0] = 30.0
        (await models.acquire(B)).release()
        now[0] = 100.0
        first = await models.unload_idle()  # A is in use; B was used 70 s ago
        lease_a.release()
        second = await models.unload_idle()  # A was given back just now
        now[0] = 200.0
        third = await models.unload_idle()
        return [first, second, third]

    try:
        assert asyncio.run(scenario()) == [[B], [], [A]]
        assert models.loaded_ids() == []
    finally:
        models.close()


def test_waiting_requests_are_served_by_model_in_arrival_order(paths):
    loader = RecordingLoader()
    models = registry({**paths, "tiny-c": paths[A]}, loader, max_loaded_models=1)

    async def scenario() -> list[str]:
        lease_a = await models.acquire(A)
        served: list[str] = []

        async def use(model_id: str) -> None:
            lease = await models.acquire(model_id)
            served.append(model_id)
            lease.release()

        waiting = []
        for model_id in ("tiny-c", B, "tiny-c"):  # C's first request came first
            waiting.append(asyncio.ensure_future(use(model_id)))
            await asyncio.sleep(0)
        leaving = asyncio.ensure_future(use(B))
        await asyncio.sleep(0)
        leaving.cancel()  # a request given up: it is no longer waited for
        await asyncio.sleep(0)
        assert models.waiting() == 3 and loader.calls == [A]  # A is still in use
        lease_a.release()
        await asyncio.wait_for(asyncio.gather(*waiting), 60)
        return served

    try:
        # C's two requests share one load, B's follows; the cancelled one loads nothing.
        assert asyncio.run(scenario()) == ["tiny-c", "tiny-c", B]
        assert loader.calls == [A, "tiny-c", B]
        assert models.waiting() == 0
    finally:
        models.close()


def test_command_line_models(tmp_path, paths):
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    args = build_parser().parse_args(["--model", paths[A], "--models-dir", str(tmp_path),
                                      "--max-loaded-models", "2",
                                      "--idle-unload-seconds", "300",
                                      "--min-loaded-seconds", "2.5"])
    config = config_from_args(args)
    assert config.model_id == paths[A]
    assert config.model_sources == {paths[A]: paths[A], "one": str(tmp_path / "one"),
                                    "two": str(tmp_path / "two")}
    assert (config.max_loaded_models, config.idle_unload_seconds) == (2, 300)
    assert config.min_loaded_seconds == 2.5
    assert config_from_args(build_parser().parse_args(["--model", "x"])).min_loaded_seconds == 10
    renamed = config_from_args(build_parser().parse_args(
        ["--model", paths[A], "--served-model-name", "mine"]))
    assert renamed.model_sources == {"mine": paths[A]}
    for argv, message in (
        (["--model", "x", "--model", "y", "--served-model-name", "z"], "names one model"),
        (["--model", "x", "--model", "x"], "two models are named 'x'"),
        ([], "no model to serve"),
        (["--models-dir", str(tmp_path / "notes")], "has no checkpoint folders"),
    ):
        with pytest.raises(MlxvlmError, match=message):
            config_from_args(build_parser().parse_args(argv))


def test_a_model_that_fails_to_load_is_a_500_and_the_others_still_answer(paths, tmp_path,
                                                                           one_model_answers):
    (tmp_path / "config.json").write_text("{}")  # a folder that is no checkpoint
    config = ServerConfig(model_id=A, model_sources={**paths, "broken": str(tmp_path)},
                          max_loaded_models=2)
    models = ModelRegistry(config, RecordingLoader())
    with LiveServer(None, None, registry=models) as server:
        client = server.client()
        assert ask(client, A) == one_model_answers[A]
        with pytest.raises(openai.InternalServerError) as error:
            ask(client, "broken")
        assert error.value.body["code"] == "model_load_failed"
        assert "'broken' could not be loaded" in error.value.body["message"]
        assert ask(client, A) == one_model_answers[A]
        assert models.loaded_ids() == [A]
