"""The sharded server batches (issue 46): rank 0's batching engine schedules, and every
pass it makes -- prefill chunks, a prompt's last chunk, decode steps over the batch,
speculative passes -- reaches the other ranks, which run it on their shards' caches.

In one process (the engine stepped by hand, a second copy of the model as the other
rank): every pass the follower runs gives bit for bit rank 0's logits, so its caches are
laid out as rank 0's through joins, leaves, a cancelled and a failing request, and
speculation's rewinds. Through the entry point (``mlx.launch ... python -m
mlxvlm.server``): concurrent clients get the one-process greedy answers while a long
stream decodes beside them and is then cancelled, /metrics shows the batch; a rank killed
under a stream ends it with a 503's error event and rank 0 stops, saying so; pipelined
with prompt lookup, the answers are the one-process ones too, and a rank frozen under a
stream (rank 0 waiting in a collective that never completes) does not keep SIGINT from
stopping rank 0."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from server_harness import png_data_url
from test_distributed import (LAUNCH, REPO, assert_every_rank_ended_well,
                              build_two_kv_heads, free_port, gone, rank_pid, stop_session)
from user_environment import user_environment

import mlxvlm
from mlxvlm.batching import BatchStep, SamplingOptions
from mlxvlm.batching import sharded_engine
from mlxvlm.batching.sharded_follower import FollowerBatch
from mlxvlm.distributed import jobs
from mlxvlm.generate import stream_generate
from mlxvlm.generate.speculative import Speculation
from mlxvlm.prompt import prepare_inputs

DEMO = REPO / "examples" / "shapes-vlm"
PICTURE = REPO / "examples" / "images" / "blue-triangle.png"
QUESTIONS = ["What is in the picture?", "Hello", "Describe the shapes.", "Count to five"]
MAX_TOKENS = 16


class Recorded:
    """A model whose every pass's output is kept."""

    def __init__(self, model):
        self.model = model
        self.outputs: list[mx.array] = []

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.outputs.append(out)
        return out


@pytest.fixture(scope="module")
def demo():
    """The demo model twice (rank 0's and the follower's), and its processor."""
    model, processor = mlxvlm.load(DEMO)
    return model, mlxvlm.load(DEMO)[0], processor


class Channel:
    """Two ranks in one process: what rank 0's broadcasts send, the other rank takes."""

    def __init__(self):
        self.sent: list = []
        self.headers: list[list[int]] = []

    def model(self, rank: int):
        group = types.SimpleNamespace(rank=lambda: rank)
        return types.SimpleNamespace(sharding=types.SimpleNamespace(group=group, rank=rank))

    def ints(self, values, length, group):
        if group.rank() == 0:
            self.headers.append(list(values))
            self.sent.append(list(values) + [0] * (length - len(values)))
            return values
        return self.sent.pop(0)

    def object(self, obj, group, announce=None):
        if group.rank() == 0:
            pickled = pickle.dumps(obj)  # (as the broadcast sends it)
            if announce is not None:
                announce()
            self.sent.append(pickled)
            return obj
        return pickle.loads(self.sent.pop(0))


def lockstep(demo, monkeypatch, **options):
    """A sharded engine over the demo model whose plans travel through jobs'
    announce_step and next_step to a follower in the same process."""
    model, copy, processor = demo
    rank0, other = Recorded(model), Recorded(copy)
    follower = FollowerBatch(other)
    channel = Channel()
    plans = []
    monkeypatch.setattr(jobs, "broadcast_ints", channel.ints)
    monkeypatch.setattr(jobs, "broadcast_object", channel.object)
    monkeypatch.setattr(jobs, "barrier", lambda group: None)

    def announce(_, plan):
        jobs.announce_step(channel.model(0), plan)
        plans.append(jobs.next_step(channel.model(1)))
        follower.apply(plans[-1])

    def release(_):
        jobs.release_steps(channel.model(0))
        plans.append(jobs.next_step(channel.model(1)))

    monkeypatch.setattr(sharded_engine, "announce_step", announce)
    monkeypatch.setattr(sharded_engine, "release_steps", release)
    engine = sharded_engine.ShardedEngine(rank0, processor, prefill_step_size=16, **options)
    engine.channel = channel
    return engine, follower, rank0, other, plans


def inputs_of(demo, question: str, image: Path | None):
    model, _, processor = demo
    return prepare_inputs(processor, question, None if image is None else str(image),
                          feature_names=model.feature_names)


def alone(demo, question: str, image: Path | None) -> list[int]:
    model, _, processor = demo
    return [r.token for r in stream_generate(model, processor, question,
                                             None if image is None else str(image),
                                             max_tokens=MAX_TOKENS)]


def submit(engine, demo, question, image, options):
    got = {"tokens": [], "error": None}

    def deliver(item):
        if isinstance(item, BatchStep):
            got["tokens"].append(item.token)
        else:
            got["error"] = item
    handle = engine.submit(inputs_of(demo, question, image), options, deliver)
    return handle, got


def run_to_end(engine, each_step=lambda: None) -> None:
    for _ in range(10_000):
        if not engine.has_work:
            engine.step()  # the idle step: what left is sent on
            return
        engine.step()
        each_step()
    raise AssertionError("the engine did not finish")


def assert_same_passes(rank0: Recorded, other: Recorded) -> None:
    assert len(other.outputs) == len(rank0.outputs) > 0
    for mine, theirs in zip(rank0.outputs, other.outputs):
        assert mine.shape == theirs.shape
        assert mx.array_equal(mine, theirs).item()


def test_the_follower_runs_rank_0s_batch_on_caches_laid_out_as_rank_0s(demo, monkeypatch):
    """Four requests batched (one with a picture), a fifth cancelled at its third token
    and a sixth whose processor raises at its fourth: the others' tokens are each
    alone's, and every pass the follower runs gives rank 0's logits."""
    from test_sequence_isolation import FailsAt, raising

    engine, follower, rank0, other, plans = lockstep(demo, monkeypatch, max_batch_size=7)
    options = SamplingOptions(max_tokens=MAX_TOKENS)
    images = [PICTURE, None, None, None]
    runs = [submit(engine, demo, q, i, options) for q, i in zip(QUESTIONS, images)]
    cancelled, cancelled_got = submit(engine, demo, "Name a colour", None, options)

    def broken(item):  # a consumer that raises (a closed event loop): its request leaves
        raise RuntimeError("event loop is closed")
    engine.submit(inputs_of(demo, "Tell a joke", None), options, broken)
    _, failing = submit(engine, demo, "Say something", None, SamplingOptions(
        max_tokens=MAX_TOKENS, extra_processors=(FailsAt(4, raising),)))

    def cancel_at_third():
        if len(cancelled_got["tokens"]) == 3:
            cancelled.cancel()
    run_to_end(engine, cancel_at_third)

    assert [got["tokens"] for _, got in runs] == [alone(demo, q, i)
                                                  for q, i in zip(QUESTIONS, images)]
    assert all(got["error"] is None for _, got in runs)
    assert len(cancelled_got["tokens"]) == 3 and cancelled_got["error"] is None
    assert isinstance(failing["error"], RuntimeError) and len(failing["tokens"]) == 3
    assert engine.stats.peak_batch_size >= 3  # (the demo answers are short)
    assert (engine.stats.requests_cancelled, engine.stats.requests_failed) == (2, 1)
    assert_same_passes(rank0, other)
    # One plan per pass (and the idle one), decode steps with nothing else to say as
    # their tokens alone; the follower holds nothing once all left.
    assert sum(plan.call is not None for plan in plans) == len(rank0.outputs)
    kinds = [header[0] for header in engine.channel.headers]
    assert kinds.count(jobs._DECODE) > 0 and kinds.count(jobs._OBJECT) > 0
    assert follower.held == {} and follower.batch is None
    engine.close()
    assert plans[-1] is None  # the release


@pytest.mark.parametrize("drafter", ("prompt lookup", "draft model"))
def test_the_follower_takes_back_what_speculation_rejects(demo, monkeypatch, drafter):
    """Speculation on a sharded model (max_batch_size 1): the answers are the plain
    loop's, and the follower's caches follow rank 0's rewinds."""
    _, copy, _ = demo
    speculation = (Speculation(prompt_lookup_num_tokens=3) if drafter == "prompt lookup"
                   else Speculation(draft_model=copy, num_draft_tokens=3))
    engine, follower, rank0, other, plans = lockstep(demo, monkeypatch, max_batch_size=1,
                                                    speculation=speculation)
    images = [PICTURE, None]
    runs = [submit(engine, demo, q, i, SamplingOptions(max_tokens=MAX_TOKENS))
            for q, i in zip(QUESTIONS, images)]
    run_to_end(engine)
    assert [got["tokens"] for _, got in runs] == [alone(demo, q, i)
                                                  for q, i in zip(QUESTIONS, images)]
    assert_same_passes(rank0, other)
    calls = [plan.call for plan in plans if plan.call is not None]
    # Passes of several tokens: drafts judged at once (a draft model that is the model
    # itself has every draft accepted).
    assert any(call.input_ids.shape[1] > 1 and call.embeddings is None for call in calls)
    if drafter == "prompt lookup":  # some drafts rejected, and taken back on every rank
        fed = {}
        rewound = 0
        for call in calls:
            if call.target is None or call.embeddings is not None:
                continue
            rewound += call.offset < fed.get(call.target, 0)
            fed[call.target] = call.offset + call.input_ids.shape[1]
        assert rewound > 0
    assert follower.held == {}
    engine.close()


def test_close_releases_the_ranks_after_the_step_under_way(demo, monkeypatch, caplog):
    """A release sent during a step would be read into its collectives: close, given a
    timeout the step outlasts, returns without releasing; the engine's thread fails the
    requests left and releases the ranks once its step ends."""
    engine, _, _, _, plans = lockstep(demo, monkeypatch)
    engine.start()
    inside, gate = threading.Event(), threading.Event()
    got = []

    def slow(item):  # holds the engine inside its step until the gate opens
        got.append(item)
        inside.set()
        gate.wait(60)
    engine.submit(inputs_of(demo, QUESTIONS[1], None), SamplingOptions(max_tokens=MAX_TOKENS),
                  slow)
    assert inside.wait(60)
    engine.close(timeout=0.1)
    assert None not in plans
    assert "released when it does" in caplog.text
    gate.set()
    engine._thread.join(60)
    assert plans[-1] is None
    assert isinstance(got[-1], mlxvlm.errors.MlxvlmError) and "shutting down" in str(got[-1])


def test_an_abandoned_engine_fails_its_requests_once_and_refuses_more(demo, monkeypatch):
    """``abandon`` (a peer seen gone, from another thread): the requests running get its
    error once and nothing after it, though the engine's thread steps on; later ones are
    refused with it; a failure behind an engine fault is still the server's (503)."""
    from mlxvlm.batching import EngineFault
    from mlxvlm.distributed.group import RankLostError
    from mlxvlm.server.answering import as_api_error, stream_failure

    engine, _, _, _, _ = lockstep(demo, monkeypatch, max_batch_size=4)
    options = SamplingOptions(max_tokens=MAX_TOKENS)
    runs = [submit(engine, demo, q, None, options) for q in QUESTIONS[1:3]]
    for _ in range(6):
        engine.step()
    assert all(got["tokens"] for _, got in runs) and engine.has_work
    lost = RankLostError("another rank left the run: rank 1 is gone")
    assert engine.abandon(lost) == 2
    delivered = [len(got["tokens"]) for _, got in runs]
    run_to_end(engine)
    assert [len(got["tokens"]) for _, got in runs] == delivered
    assert all(got["error"] is lost for _, got in runs)
    assert engine.abandon(RankLostError("again")) == 0
    with pytest.raises(RankLostError, match="rank 1 is gone"):
        submit(engine, demo, QUESTIONS[0], None, options)
    fault = EngineFault("the decode step failed")
    fault.__cause__ = lost
    assert stream_failure(fault) == (503, str(lost))
    refused = as_api_error(fault)
    assert (refused.status, refused.code) == (503, "rank_lost")
    engine.close()


def test_close_gives_up_on_an_abandoned_engine_whose_step_never_ends(demo, monkeypatch):
    """A step that waits on a lost rank (here, a consumer that blocks it): close, which by
    default waits the step out, returns once the engine is abandoned; the engine is
    ``stuck`` until its step ends, and then releases the ranks."""
    from mlxvlm.distributed.group import RankLostError

    monkeypatch.setattr(sharded_engine, "ABANDONED_WAIT", 0.1)
    engine, _, _, _, plans = lockstep(demo, monkeypatch)
    engine.start()
    inside, gate = threading.Event(), threading.Event()
    got = []

    def blocked(item):
        got.append(item)
        inside.set()
        gate.wait(60)
    engine.submit(inputs_of(demo, QUESTIONS[1], None), SamplingOptions(max_tokens=MAX_TOKENS),
                  blocked)
    assert inside.wait(60)
    closing = threading.Thread(target=engine.close)
    closing.start()
    lost = RankLostError("rank 1 is gone")
    threading.Timer(0.2, engine.abandon, args=(lost,)).start()
    closing.join(60)
    assert not closing.is_alive() and engine.stuck
    assert None not in plans  # (not released under the step)
    gate.set()
    engine._thread.join(60)
    assert not engine.stuck and plans[-1] is None
    assert got[-1] is lost  # and nothing after it


# -- through the entry point ------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Qwen2-VL with two key/value heads (one per rank)."""
    return build_two_kv_heads("qwen2_vl", tmp_path_factory.mktemp("sharded-server") / "qwen2_vl")


def chat(question: str, image=None, **fields) -> dict:
    content = question if image is None else [
        {"type": "image_url", "image_url": {"url": png_data_url(image)}},
        {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": MAX_TOKENS, **fields}


def answer(base: str, body: dict) -> str:
    response = httpx.post(f"{base}/v1/chat/completions", json={"model": "m", **body},
                          timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_the_sharded_server_answers_concurrent_clients_as_one_process(checkpoint, tmp_path):
    """Under mlx.launch (two ranks, tensor parallel): a long stream decodes while four
    clients (one with a picture) ask at once; each gets the one-process greedy answer;
    the long stream, cancelled mid-way, had streamed the start of its own answer and the
    next request is answered as before; /metrics shows the batch and the cancellation.
    Then rank 1 is killed under another long stream and rank 0 sent SIGTERM: the stream
    ends with a 503's error event, and rank 0 exits, logging that rank 1 is gone."""
    from tiny import make_image

    picture = make_image(64, 48)
    picture.save(tmp_path / "picture.png")
    bodies = [chat(QUESTIONS[0], picture)] + [chat(q) for q in QUESTIONS[1:]]
    long_body = chat("Tell me a long story.", max_tokens=400)

    with launched_server(checkpoint, tmp_path, "--max-concurrency", "5") as (server, base,
                                                                         log_path):
        model, processor = mlxvlm.load(checkpoint)  # one process, the reference, as it starts
        expected = [mlxvlm.generate(model, processor, [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]}],
            str(tmp_path / "picture.png"), max_tokens=MAX_TOKENS).text]
        expected += [mlxvlm.generate(model, processor, [{"role": "user", "content": q}],
                                     max_tokens=MAX_TOKENS).text for q in QUESTIONS[1:]]
        long_reference = mlxvlm.generate(model, processor, long_body["messages"],
                                         max_tokens=400)
        assert long_reference.finish_reason == "length"  # (it outlasts the others)
        long_expected = long_reference.text
        wait_until_up(base, server, log_path)
        streamed: list[str] = []
        decoding, others_done = threading.Event(), threading.Event()

        def long_stream():
            with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=300,
                              json={"model": "m", **long_body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        streamed.append(delta.get("content") or "")
                        if len(streamed) >= 3:
                            decoding.set()
                    # the client leaves mid-way: once the others are answered, or at
                    # half its answer if they take longer (a batched decode may be fast
                    # enough to finish 400 tokens first: the leaving must not depend on it)
                    if others_done.is_set() or len(streamed) >= 200:
                        return
        holder = threading.Thread(target=long_stream)
        holder.start()
        assert decoding.wait(120)
        answers: list = [None] * len(bodies)

        def ask(i):
            answers[i] = answer(base, bodies[i])
        askers = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
        for thread in askers:
            thread.start()
        for thread in askers:
            thread.join(300)
        others_done.set()
        holder.join(300)
        after = answer(base, bodies[1])
        metrics = httpx.get(f"{base}/metrics", timeout=60).text
        output = log_path.read_text()
        # Rank 1 killed while a stream decodes, then rank 0 told to stop (as mlx.launch
        # also tells it, seeing rank 1's exit): it stops, saying why.
        rank0, rank1 = rank_pid(server.pid, 0), rank_pid(server.pid, 1)
        with Streaming(base, long_body) as lost:
            os.kill(rank1, signal.SIGKILL)
            assert gone(rank1, 60)
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank0, signal.SIGTERM)
        assert gone(rank0, 30), log_path.read_text()
        server.wait(60)  # (mlx.launch passes on the last of rank 0's output)
        stopped = log_path.read_text()[len(output):]
    assert answers == expected
    assert after == expected[1]
    text = "".join(streamed)
    assert text and long_expected.startswith(text) and text != long_expected
    assert metric(metrics, "mlxvlm_peak_batch_size") >= 2
    assert metric(metrics, "mlxvlm_sequences_cancelled_total") == 1
    assert metric(metrics, "mlxvlm_sequences_finished_total") == len(bodies) + 1
    assert_every_rank_ended_well(output)
    # Rank 1 gone: the stream in flight ends with a 503's error rather than waiting, and
    # rank 0 exits (not 0: mlx.launch names its code) with the reason.
    assert lost.error is not None and lost.error["type"] == "server_error", lost.lines[-3:]
    assert "another rank left the run" in lost.error["message"]
    assert "stopping: rank 1 is gone (its connection to rank 0 closed)" in stopped, stopped
    # (expected operation: one warning, no traceback)
    # the stream's end is seen either by the failed collective ("rank 0 of 2: another rank
    # left the run ...") or by the peer watch first ("another rank left the run: ...")
    assert any(line.startswith("WARNING mlxvlm.server: a streamed answer ended with a 503: ")
               and "another rank left the run" in line
               for line in stopped.splitlines()), stopped
    assert "Traceback" not in stopped, stopped
    assert "Node with rank 0 exited with code" in stopped, stopped


def test_the_pipelined_server_speculates(checkpoint, tmp_path):
    """Under mlx.launch with --pipeline and prompt lookup (--max-concurrency 1): two
    requests, each the one-process greedy answer. Then rank 1 is frozen (SIGSTOP) under a
    long stream and rank 0 sent SIGINT: the stream ends with an error event saying the
    server stops, and rank 0, its step stuck, exits with status 1 saying so."""
    prompts = ["Repeat: one two three one two three one two three", QUESTIONS[1]]
    with launched_server(checkpoint, tmp_path, "--pipeline", "--max-concurrency", "1",
                         "--prompt-lookup-num-tokens", "3") as (server, base, log_path):
        model, processor = mlxvlm.load(checkpoint)  # one process, the reference, as it starts
        expected = [mlxvlm.generate(model, processor, [{"role": "user", "content": p}],
                                    max_tokens=MAX_TOKENS).text for p in prompts]
        wait_until_up(base, server, log_path)
        answers = [answer(base, chat(p)) for p in prompts]
        output = log_path.read_text()
        # Rank 1 frozen (there, but not answering) while a stream decodes: rank 0's step
        # waits in a collective that never completes, and SIGINT still stops it.
        rank0, rank1 = rank_pid(server.pid, 0), rank_pid(server.pid, 1)
        try:
            with Streaming(base, chat("Tell me a long story.", max_tokens=400)) as cut:
                os.kill(rank1, signal.SIGSTOP)
                os.kill(rank0, signal.SIGINT)
            assert gone(rank0, 30), log_path.read_text()
        finally:
            os.kill(rank1, signal.SIGKILL)
        server.wait(60)  # (mlx.launch passes on the last of rank 0's output)
        stopped = log_path.read_text()[len(output):]
    assert answers == expected
    assert_every_rank_ended_well(output)
    assert cut.error is not None and cut.error["type"] == "server_error", cut.lines[-3:]
    assert "the server is stopping (on SIGINT)" in cut.error["message"]
    for line in ("stopping on SIGINT", "exiting without releasing the other ranks",
                 "Node with rank 0 exited with code 1",
                 "a streamed answer ended with a 503: the server is stopping (on SIGINT)"):
        assert line in stopped, stopped
    assert "Traceback" not in stopped, stopped


def test_the_pipelined_server_answers_llama_3_2_vision_as_one_process(tiny_checkpoints,
                                                                      tmp_path):
    """Under mlx.launch with --pipeline, Llama 3.2 Vision (a cross-attention layer on
    each rank): a question on a picture, then one without, each the one-process greedy
    answer -- the decode batch's state carries no image states, so each rank reads the
    keys its own cross-attention layer cached. Then mlx.launch alone is stopped (SIGTERM):
    both ranks, their launcher gone, stop too."""
    from tiny import make_image

    checkpoint = tiny_checkpoints.path("mllama", "hub")
    picture = make_image(64, 48)
    picture.save(tmp_path / "picture.png")
    with launched_server(checkpoint, tmp_path, "--pipeline") as (server, base, log_path):
        model, processor = mlxvlm.load(checkpoint)  # one process, the reference, as it starts
        expected = [mlxvlm.generate(model, processor, [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]}],
            str(tmp_path / "picture.png"), max_tokens=MAX_TOKENS, temperature=0.0).text,
            mlxvlm.generate(model, processor, [{"role": "user", "content": QUESTIONS[1]}],
                            max_tokens=MAX_TOKENS, temperature=0.0).text]
        wait_until_up(base, server, log_path)
        answers = [answer(base, chat(QUESTIONS[0], picture)),
                   answer(base, chat(QUESTIONS[1]))]
        output = log_path.read_text()
        # mlx.launch stopped (SIGTERM, which it does not pass on): its ranks see it gone
        # and stop rather than serve on (their words went with its pipes).
        ranks = [rank_pid(server.pid, rank) for rank in (0, 1)]
        server.terminate()
        server.wait(60)
        assert all(gone(pid, 30) for pid in ranks)
    assert answers == expected
    assert_every_rank_ended_well(output)


@contextlib.contextmanager
def launched_server(checkpoint: Path, tmp_path: Path, *flags: str):
    """``python -m mlxvlm.server`` on two ranks (mlx.launch, ring over loopback), started:
    (its process, base URL, log's path) while it starts up (the caller computes its
    one-process references meanwhile, then waits with ``wait_until_up``), then stopped."""
    port = free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
             "--starting-port", str(free_port()), "--env", f"PYTHONPATH={REPO}",
             "--python", sys.executable, "--", "-m", "mlxvlm.server", "--model",
             str(checkpoint), "--served-model-name", "m", "--port", str(port), *flags],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=user_environment(),
            start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            yield server, base, log_path
        finally:
            stop_session(server)



class Streaming:
    """``with Streaming(base, body) as stream:`` a streamed chat request, entered once its
    first words arrived; leaving waits for its end: ``lines`` (the events' data) and
    ``error`` (the error event's, or None)."""

    def __init__(self, base: str, body: dict):
        self.base, self.body = base, body
        self.lines: list[str] = []
        self.error: dict | None = None
        self._decoding = threading.Event()
        self._thread = threading.Thread(target=self._read)

    def _read(self) -> None:
        try:
            with httpx.stream("POST", f"{self.base}/v1/chat/completions", timeout=120,
                              json={"model": "m", **self.body, "stream": True}) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    self.lines.append(line[6:])
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]
                    elif event["choices"] and event["choices"][0]["delta"].get("content"):
                        self._decoding.set()
        except httpx.TransportError:
            pass  # (no error event: asserted on by the caller)
        finally:
            self._decoding.set()

    def __enter__(self) -> "Streaming":
        self._thread.start()
        assert self._decoding.wait(120)
        return self

    def __exit__(self, *_) -> None:
        self._thread.join(120)
        assert not self._thread.is_alive(), "the stream did not end"


def metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith((name + " ", name + "{")))


def wait_until_up(base: str, server: subprocess.Popen, log: Path) -> None:
    import time

    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert server.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
