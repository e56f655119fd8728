"""Sharded inference over MLX's distributed engine: two ranks on this machine, launched
as a user launches them (``mlx.launch --backend ring --hosts 127.0.0.1 -n 2``), against
the same checkpoint in one process. Greedy tokens must be identical in tensor and
pipeline mode, for a family on an mlx-lm backbone (LLaVA-OneVision's qwen2) and one on
mlxvlm's own decoder (Qwen2-VL's M-RoPE); each rank must hold only its shard. Answers
end on the token budget and on end of sequence (``EOS``: a copy of the Qwen2-VL
checkpoint whose end-of-sequence ids are tokens its greedy answers emit), after which
every rank must still be in step with rank 0 and end without an error.

mlx.launch exits 0 whatever its ranks do: a rank that failed shows only in the output
(its traceback, the launcher's ``Node with rank 1 exited with code 1``), which the
launches here check."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from raw_http import CHAT_HEAD, assert_raw_error, raw_socket, read_response
from user_environment import user_environment

import mlxvlm
from mlxvlm.convert import convert
from mlxvlm.distributed.broadcast import broadcast_object
from mlxvlm.distributed.group import ShardPlan
from mlxvlm.generate import stream_generate
from mlxvlm.checkpoint.loading import load
from mlxvlm.models.layers.mrope_decoder import MRopeState
from mlxvlm.text.tokenization import processor_state

REPO = Path(mlxvlm.__file__).resolve().parent.parent
LAUNCH = Path(sys.executable).parent / "mlx.launch"
RUNNER = Path(__file__).parent / "sharded_run.py"
FAMILIES = ("qwen2_vl", "llava_onevision")
QUANTIZED = "qwen2_vl-8bit"
EOS = "qwen2_vl-eos"
PROMPT = "Describe this image."
CHAT = [{"role": "user", "content": "Hello"}]
BUDGET = 12  # max_tokens of every run here


_handed_out: set[int] = set()


def free_port() -> int:
    """A port the ring backend can listen on (it takes this one and the next), never
    within a few of one handed out before: launches started together have not bound
    theirs yet."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if any(abs(port - taken) < 4 for taken in _handed_out):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        _handed_out.add(port)
        return port


class Launched:
    """``command`` (after the interpreter) on ``ranks`` ranks over loopback, started: the
    caller works on while the ranks start up (each imports for seconds), then
    ``finish`` waits for them. The output goes to files: a pipe nobody reads meanwhile
    could fill and stall the ranks."""

    def __init__(self, *command: str, ranks: int = 2, timeout: int = 240):
        import tempfile

        self.timeout = timeout
        self.command = [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n",
                        str(ranks), "--starting-port", str(free_port()), "--env",
                        f"PYTHONPATH={REPO}", "--python", sys.executable, "--", *command]
        self.stdout, self.stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(self.command, stdout=self.stdout, stderr=self.stderr,
                                        text=True, cwd=REPO, env=user_environment(),
                                        start_new_session=True)

    def finish(self) -> subprocess.CompletedProcess:
        try:
            self.process.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            stop_session(self.process)
            raise
        outputs = []
        for stream in (self.stdout, self.stderr):
            stream.seek(0)
            outputs.append(stream.read())
            stream.close()
        return subprocess.CompletedProcess(self.command, self.process.returncode, *outputs)

    def __enter__(self) -> "Launched":
        return self

    def __exit__(self, *failure) -> None:
        if self.process.poll() is None:  # the caller failed before ``finish``
            stop_session(self.process)


def launch(*command: str, timeout: int = 240, ranks: int = 2) -> subprocess.CompletedProcess:
    """``command`` (after the interpreter) on ``ranks`` ranks over loopback."""
    with Launched(*command, ranks=ranks, timeout=timeout) as launched:
        return launched.finish()


def assert_every_rank_ended_well(output: str) -> None:
    """No rank failed: mlx.launch's exit code does not say (it is 0 regardless), so its
    warnings and the ranks' tracebacks in ``output`` do."""
    for sign in ("Traceback", "exited with code", "was killed", "error:"):
        assert sign not in output, output


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def build_two_kv_heads(family: str, directory: Path) -> Path:
    """The family's tiny checkpoint with 2 key/value heads, so that two ranks can split
    them (the suite's tiny models have one)."""
    import tiny

    module = tiny.builder(family)
    original = module._config

    def config(*args, **kwargs):
        made = original(*args, **kwargs)
        made.text_config.num_key_value_heads = 2
        return made

    module._config = config
    try:
        model = module.build_tiny_model(family, 2)
    finally:
        module._config = original
    return module.save_checkpoint(model, directory, "transformers")


def with_eos_in_answers(source: Path, directory: Path, image: Path) -> Path:
    """A copy of ``source`` whose end-of-sequence ids add the fourth greedy token of the
    answers the launches here ask for (the image prompt, the chat): those answers end on
    end of sequence, with the loop's next step already scheduled."""
    model, processor = load(source)
    answers = [stream_generate(model, processor, PROMPT, str(image), max_tokens=BUDGET),
               stream_generate(model, processor, CHAT, max_tokens=BUDGET)]
    ends = {[r.token for r in answer][3] for answer in answers}
    shutil.copytree(source, directory)
    config_path = directory / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = sorted(ends | set(processor_state(processor).eos_token_ids))
    config_path.write_text(json.dumps(config))
    return directory


def ends_on_eos(results: list) -> list:
    """``results`` (a stream's), checked to end on end of sequence after the second token
    (when the next step is in flight) and before the budget."""
    last = results[-1]
    assert last.finish_reason == "stop" and last.stop_string is None
    assert 2 <= len(results) < BUDGET, len(results)
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tiny import make_image

    root = tmp_path_factory.mktemp("sharded")
    image = root / "image.png"
    make_image(64, 48).save(image)
    paths = {family: build_two_kv_heads(family, root / family) for family in FAMILIES}
    # 8-bit (groups of 32: a rank's half of a 64-wide input is one group), as most
    # checkpoints that need several Macs are quantized.
    paths[QUANTIZED] = convert(str(paths["qwen2_vl"]), root / QUANTIZED, quantize=True,
                               q_bits=8, q_group_size=32).path
    paths[EOS] = with_eos_in_answers(paths["qwen2_vl"], root / EOS, image)
    return paths, image


@pytest.mark.parametrize("family", (*FAMILIES, QUANTIZED, EOS))
def test_two_ranks_give_one_process_tokens(checkpoints, sharded_runs, family):
    paths, image = checkpoints
    model, processor = load(paths[family])
    assert model.sharding is None  # no launcher: the whole model
    results = list(stream_generate(model, processor, PROMPT, str(image), max_tokens=BUDGET))
    if family == EOS:
        ends_on_eos(results)
    reference = [r.token for r in results]
    whole = dict(_flat_shapes(model))
    lines = [line for line in sharded_runs if line["checkpoint"] == str(paths[family])]
    for mode in ("tensor", "pipeline"):
        tokens = [line["tokens"] for line in lines if line["mode"] == mode and "tokens" in line]
        assert tokens == [reference], mode
        held = {line["rank"]: line for line in lines if line["mode"] == mode and "rank" in line}
        assert set(held) == {0, 1}
        # Rank 0 alone holds the towers; rank 1 only the text model.
        towers = {k for k in whole if not k.startswith("language_model.")}
        assert towers and towers <= set(held[0]["parameters"])
        assert all(k.startswith("language_model.") for k in held[1]["parameters"])
        assert_holds_shard(mode, held, whole)


EVERY_FAMILY = tuple(sorted(__import__("tiny").GENERATIVE))  # retrieval models embed
BF16, Q4 = "qwen3_5-bf16", "qwen2_vl-4bit"
# Blocks split by what they hold beyond attention and gated MLPs: (family, a weight rank
# 1 holds half the rows of) -- GLM-4's fused gate/up projection, GLM-4.5's shared
# experts, Llama 3.2 Vision's cross-attention heads, each Qwen3-MoE expert (InternVL3.5's).
SPLIT_ROWS = (("glm4v", "language_model.model.layers.0.mlp.gate_up_proj.weight"),
              ("glm_ocr", "language_model.model.layers.0.mlp.gate_up_proj.weight"),
              ("glm4v_moe", "language_model.model.layers.1.mlp.shared_experts.gate_proj.weight"),
              ("mllama", "language_model.model.layers.1.cross_attn.q_proj.weight"),
              ("internvl_moe", "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"))


@pytest.fixture(scope="module")
def family_paths(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Every registered family's tiny checkpoint (one key/value head: the ranks repeat
    it), a bfloat16 one (what a rank holds is 16-bit, as one process) and a 4-bit one."""
    root = tmp_path_factory.mktemp("families")
    paths = {family: tiny_checkpoints.path(family, "hub") for family in EVERY_FAMILY}
    paths[BF16] = convert(str(paths["qwen3_5"]), root / BF16, dtype="bfloat16").path
    paths[Q4] = convert(str(paths["qwen2_vl"]), root / Q4, quantize=True, q_bits=4,
                        q_group_size=32).path
    return paths


@pytest.fixture(scope="module")
def launched_runs(checkpoints, family_paths, tmp_path_factory):
    """tests/sharded_run.py on two ranks over every checkpoint here, each in both modes:
    one launch (a launch costs two start-ups), started before the one-process references
    are computed, which run meanwhile."""
    paths, image = checkpoints
    out = tmp_path_factory.mktemp("held") / "runs"
    out.mkdir()
    listed = [paths[name] for name in (*FAMILIES, QUANTIZED, EOS)] + list(family_paths.values())
    with Launched(str(RUNNER), ",".join(str(path) for path in listed), str(image),
                  "tensor,pipeline", str(out), timeout=1800) as launched:
        yield launched, out


@pytest.fixture(scope="module")
def family_checkpoints(family_paths, checkpoints, launched_runs):
    """Each family checkpoint's one-process greedy answer (temperature 0: some
    checkpoints' generation configs sample) and parameter shapes."""
    _, image = checkpoints
    answers, shapes = {}, {}
    for name, path in family_paths.items():
        model, processor = load(path)
        answers[name] = [r.token for r in stream_generate(
            model, processor, PROMPT, str(image), max_tokens=BUDGET, temperature=0.0)]
        shapes[name] = dict(_flat_shapes(model))
    return family_paths, answers, shapes, image


@pytest.fixture(scope="module")
def sharded_runs(launched_runs, family_checkpoints) -> list[dict]:
    """The launch's lines: rank 0's answers and what each rank held, as dicts; every
    rank must have ended well."""
    launched, out = launched_runs
    run = launched.finish()
    assert run.returncode == 0, run.stdout + run.stderr
    assert_every_rank_ended_well(run.stderr)
    held = [json.loads(path.read_text()) for path in sorted(out.glob("*.json"))]
    return json_lines(run.stdout) + held


@pytest.mark.parametrize("mode", ("tensor", "pipeline"))
def test_every_family_on_two_ranks_gives_one_process_tokens(family_checkpoints,
                                                            sharded_runs, mode):
    """The launch loops over every family's checkpoint on both ranks: each answer is the
    one process's; a tensor-parallel rank holds 16-bit weights as 16-bit and 4-bit ones
    as 4-bit."""
    paths, answers, shapes, _ = family_checkpoints
    listed = {str(path) for path in paths.values()}
    lines = [line for line in sharded_runs
             if line["mode"] == mode and line["checkpoint"] in listed]
    assert not [line for line in lines if "error" in line]
    got = {name: [line["tokens"] for line in lines
                  if line.get("checkpoint") == str(path) and "tokens" in line]
           for name, path in paths.items()}
    assert got == {name: [answer] for name, answer in answers.items()}
    held = {(line["checkpoint"], line["rank"]): line for line in lines if "rank" in line}
    assert len(held) == 2 * len(paths)
    if mode == "tensor":
        q = "language_model.model.layers.3.self_attn.q_proj.weight"  # a full-attention layer
        for rank in (0, 1):
            line = held[(str(paths[BF16]), rank)]
            assert line["dtypes"][q] == "bfloat16"
            assert all(d in ("bfloat16", "float32") for d in line["dtypes"].values())
        quantized = held[(str(paths[Q4]), 1)]
        k = "language_model.model.layers.0.self_attn.k_proj"
        assert quantized["dtypes"][f"{k}.weight"] == "uint32"
        assert quantized["parameters"][f"{k}.weight"][1] == 64 * 4 // 32  # 4-bit words
        for family, name in SPLIT_ROWS:
            *experts, rows, columns = shapes[family][name]  # experts: (experts, rows, columns)
            assert held[(str(paths[family]), 1)]["parameters"][name] == [*experts, rows // 2,
                                                                          columns]


def _flat_shapes(model) -> list[tuple[str, list[int]]]:
    from mlx.utils import tree_flatten

    return [(k, list(v.shape)) for k, v in tree_flatten(model.parameters())]


def assert_holds_shard(mode: str, held: dict, whole: dict) -> None:
    rank1 = held[1]["parameters"]
    if mode == "pipeline":
        # mlx-lm's order: rank 1 the first layer, rank 0 the last; both the head's parts.
        assert held[1]["describe"].startswith("rank 1: layer 0 of 2")
        assert held[0]["describe"].startswith("rank 0: layer 1 of 2")
        assert not any(".layers.1." in k for k in rank1)
        assert not any(".layers.0." in k for k in held[0]["parameters"]
                       if k.startswith("language_model."))
        return
    assert held[1]["describe"].startswith("rank 1: half of every attention and MLP")
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    down = "language_model.model.layers.0.mlp.down_proj.weight"
    # Half the outputs of q, half the inputs of down (packed words too, when quantized).
    assert rank1[q] == [whole[q][0] // 2, whole[q][1]]
    assert rank1[down] == [whole[down][0], whole[down][1] // 2]
    assert set(rank1) == {k for k in whole if k.startswith("language_model.")}


@pytest.mark.parametrize("mode", ("pipeline", "tensor"))
def test_cli_under_mlx_launch_prints_once_what_one_process_prints(checkpoints, capsys,
                                                                  monkeypatch, mode):
    """Answers that end on end of sequence: in pipeline mode the demo model's, by
    docs/distributed.md's command (its one key/value head cannot be split in tensor
    mode), in tensor mode the EOS checkpoint's. Every rank ends well."""
    from mlxvlm.generate.__main__ import main as run_generate_cli

    paths, image = checkpoints
    if mode == "pipeline":
        args = ["--pipeline", "--verbose", "--model", "examples/shapes-vlm",
                "--image", "examples/images/blue-triangle.png",
                "--prompt", "What is in the picture?"]
    else:
        args = ["--verbose", "--model", str(paths[EOS]), "--image", str(image),
                "--max-tokens", str(BUDGET)]
    monkeypatch.chdir(REPO)  # the documented command's relative paths
    with Launched("-m", "mlxvlm.generate", *args) as launched:
        assert run_generate_cli(args) == 0  # one process, the reference, as the ranks start
        alone = capsys.readouterr()
        run = launched.finish()
    assert "tokens/s (stop)" in alone.err  # it ends on end of sequence
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout == alone.out  # rank 0 alone prints the answer
    assert_every_rank_ended_well(run.stderr)
    if mode == "pipeline":
        assert "rank 1: layer 0 of 2 (pipeline over 2 ranks)" in run.stderr
        assert ("rank 0: layer 1 of 2 (pipeline over 2 ranks); the vision/audio towers"
                in run.stderr)
    else:
        assert "rank 1: half of every attention and MLP (tensor parallel" in run.stderr


def test_the_advice_of_a_refused_split_works(tiny_checkpoints, capsys):
    """Three ranks cannot split Gemma 3's two query heads: `mlxvlm.generate` says so in
    one line that names --pipeline (each rank that gets to say it before the launcher
    stops it on the first one's exit), and that command, as advised, prints what one
    process prints."""
    from mlxvlm.generate.__main__ import main as run_generate_cli

    args = ["--model", str(tiny_checkpoints.path("gemma3", "hub")), "--prompt", "Hello",
            "--max-tokens", "6"]
    # Both launches and the one process at once (each launch's ranks mostly start up).
    with (Launched("-m", "mlxvlm.generate", *args, ranks=3) as refused_launch,
          Launched("-m", "mlxvlm.generate", "--pipeline", *args, ranks=3) as advised_launch):
        assert run_generate_cli(args) == 0
        alone = capsys.readouterr().out
        refused, advised = refused_launch.finish(), advised_launch.finish()
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors and errors == [errors[0]] * len(errors) and len(errors) <= 3, refused.stderr
    assert errors[0] == (
        "error: the gemma3 text model cannot be split over 3 ranks in tensor mode (layer 0's "
        "2 attention heads do not split over 3 ranks); run with --pipeline (each rank a run "
        "of layers)")
    assert "Traceback" not in refused.stderr
    assert_every_rank_ended_well(advised.stderr)
    assert advised.stdout == alone


def test_server_under_mlx_launch_answers_as_one_process(checkpoints, tmp_path):
    """Rank 0 serves HTTP, rank 1 follows its requests: the greedy answers, which end on
    end of sequence and on a stop string, are the one process's, and rank 1 is still in
    step after each; rank 0 serves under the same connection guards as one process (a
    request whose headers stop gets 408 at --header-timeout)."""
    paths, _ = checkpoints
    port = free_port()
    log = (tmp_path / "server.log").open("w")  # a pipe nobody reads could fill and block
    server = subprocess.Popen(
        [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
         "--starting-port", str(free_port()), "--env", f"PYTHONPATH={REPO}",
         "--python", sys.executable, "--", "-m", "mlxvlm.server", "--model",
         str(paths[EOS]), "--port", str(port), "--header-timeout", "1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=user_environment(),
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        # One process, the reference, while the ranks start.
        model, processor = load(paths[EOS])
        expected = "".join(r.text for r in ends_on_eos(
            list(stream_generate(model, processor, CHAT, max_tokens=BUDGET))))
        stop, expected_stopped = stopped_early(model, processor)
        served = _get_when_up(f"{base}/models", server, tmp_path / "server.log")["data"][0]["id"]
        request = {"model": served, "messages": CHAT, "temperature": 0, "max_tokens": BUDGET}
        # Rank 1 follows more than one request, each ending before the budget.
        answers = [_post(f"{base}/chat/completions", json.dumps(body).encode())
                   for body in (request, request, {**request, "stop": [stop]})]
        with raw_socket(port, CHAT_HEAD) as stalled:  # headers that never end
            assert_raw_error(read_response(stalled), 408, code="request_timeout")
        output = (tmp_path / "server.log").read_text()  # before the ranks are stopped
    finally:
        stop_session(server)
        log.close()
    assert [(a["choices"][0]["message"]["content"], a["choices"][0]["finish_reason"])
            for a in answers] == [(expected, "stop"), (expected, "stop"),
                                  (expected_stopped, "stop")]
    assert_every_rank_ended_well(output)


def session_pids(session: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == session:
                pids.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return pids


def rank_pid(session: int, rank: int, module: str = "mlxvlm.server") -> int:
    """The process of ``rank`` (running ``python -m module``) among those mlx.launch
    started in ``session``."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or os.getsid(int(entry.name)) != session:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ProcessLookupError):
            continue
        if f"MLX_RANK={rank}".encode() in environ and module.encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} in session {session}")


def gone(pid: int, timeout: float) -> bool:
    """Waits until process ``pid`` has exited (or is a zombie), for ``timeout`` s at most."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def stop_session(server: subprocess.Popen) -> None:
    """mlx.launch and every rank it started: a rank in a process group of its own
    outlives a signal to the launcher's group (seen: rank 0 left serving, reparented)."""
    for pid in [server.pid, *session_pids(server.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
    deadline = time.monotonic() + 30
    while session_pids(server.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in session_pids(server.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stopped_early(model, processor) -> tuple[str, str]:
    """A stop string that ends the chat's greedy answer at its second token or later,
    before its end of sequence (the text of a token not seen before it), and the answer
    it leaves (one process's)."""
    results = list(stream_generate(model, processor, CHAT, max_tokens=BUDGET))
    for n in range(1, len(results) - 1):
        stop, before = results[n].text, "".join(r.text for r in results[:n])
        if stop and stop not in before:
            stopped = list(stream_generate(model, processor, CHAT, max_tokens=BUDGET,
                                           stop=stop))
            assert stopped[-1].stop_string == stop and len(stopped) == n + 1
            return stop, "".join(r.text for r in stopped)
    raise AssertionError(f"no token's text in {[r.text for r in results]} is new")


def _get_when_up(url: str, server: subprocess.Popen, log: Path) -> dict:
    """GET ``url`` once the server listens (it loads first); fails if it exited."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, ConnectionError):
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)


def _post(url: str, body: bytes) -> dict:
    import urllib.request

    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_a_rank_that_exits_ends_the_run(checkpoints, tmp_path):
    """Rank 1 exits after loading: the run ends (no hang) and says which rank left."""
    paths, image = checkpoints
    script = tmp_path / "leave.py"
    script.write_text(
        "import os, sys\n"
        "import mlxvlm\n"
        "from mlxvlm.checkpoint.loading import load\n"
        "from mlxvlm.generate import generate\n"
        "model, processor = load(sys.argv[1], shard='tensor')\n"
        "if model.sharding.rank == 1:\n"
        "    os._exit(3)\n"
        "try:\n"
        "    generate(model, processor, 'Hello', max_tokens=4)\n"
        "except Exception as exc:\n"
        "    print(f'rank 0: {type(exc).__name__}: {exc}', flush=True)\n"
        "    raise SystemExit(1)\n"
    )
    run = launch(str(script), str(paths["llava_onevision"]), timeout=120)
    output = run.stdout + run.stderr
    assert "rank 1 exited with code 3" in output
    # Rank 0 reports it unless the launcher, seeing rank 1 gone, stopped it first.
    reported = "RankLostError: rank 0 of 2: another rank left the run" in output
    assert reported or "rank 0 exited with code -15" in output, output


def test_a_rank_that_fails_on_the_release_fails_rank_0(tmp_path):
    """Rank 1 takes rank 0's release and raises before acknowledging it: rank 1 exits
    non-zero (mlx.launch names it) and rank 0's release fails rather than ending well
    without it."""
    script = tmp_path / "fail_on_release.py"
    script.write_text(
        "import types\n"
        "import mlxvlm\n"
        "import mlx.core as mx\n"
        "from mlxvlm.distributed.broadcast import broadcast_object\n"
        "from mlxvlm.distributed.group import ShardPlan\n"
        "from mlxvlm.distributed.jobs import release\n"
        "group = mx.distributed.init()\n"
        "model = types.SimpleNamespace(sharding=ShardPlan(group, 'tensor'))\n"
        "if group.rank() == 1:\n"
        "    assert broadcast_object(None, group) is None  # the release, as next_job takes it\n"
        "    raise RuntimeError('rank 1 failed on the release')\n"
        "try:\n"
        "    release(model)\n"
        "except Exception as exc:\n"
        "    print(f'rank 0: {type(exc).__name__}: {exc}', flush=True)\n"
        "    raise SystemExit(1)\n"
        "print('rank 0: released', flush=True)\n"
    )
    run = launch(str(script), timeout=120)
    output = run.stdout + run.stderr
    assert "RuntimeError: rank 1 failed on the release" in output
    assert "rank 0: released" not in output
    # Rank 0 reports it unless the launcher, seeing rank 1 gone, stopped it first.
    reported = "rank 0: RankLostError: rank 0 of 2: another rank left the run" in output
    assert reported or "rank 0 exited with code -15" in output, output
    # Whichever ends first, the launcher stops the other: rank 1 exits 1 on its error, or
    # rank 0, having reported the lost rank, exits 1 while rank 1 is still shutting down.
    assert ("rank 1 exited with code 1" in output
            or (reported and "rank 0 exited with code 1" in output)), output


def test_the_generate_command_stops_when_a_rank_is_gone(checkpoints):
    """``python -m mlxvlm.generate`` on two ranks, twice at once, each writing a long
    answer, their launcher frozen meanwhile (mlx.launch would otherwise stop the rank
    left itself, with SIGTERM). Rank 1 killed under one: rank 0 sees it gone and ends
    promptly, status 1, with a one-line error naming it -- rather than wait inside a
    collective that never completes. Rank 0 alone interrupted (SIGINT) under the other:
    it ends at once, `interrupted` (status 130; no release the other rank, inside the
    answer's collectives, could not take), and rank 1 sees it gone and ends, status 1."""
    paths, _ = checkpoints
    args = ["-m", "mlxvlm.generate", "--model", str(paths["qwen2_vl"]), "--prompt",
            "Tell me a long story.", "--max-tokens", "100000", "--temperature", "0"]
    with Launched(*args) as lose_1, Launched(*args) as interrupt_0:
        for launched, rank, sent in ((lose_1, 1, signal.SIGKILL),
                                     (interrupt_0, 0, signal.SIGINT)):
            deadline = time.monotonic() + 240
            while os.fstat(launched.stdout.fileno()).st_size < 100:  # (answering)
                assert launched.process.poll() is None, launched.finish()
                assert time.monotonic() < deadline, "no answer came"
                time.sleep(0.1)
            session = launched.process.pid
            pids = [rank_pid(session, r, "mlxvlm.generate") for r in (0, 1)]
            os.kill(session, signal.SIGSTOP)
            try:
                os.kill(pids[rank], sent)
                for r in (0, 1):
                    assert gone(pids[r], 60), f"rank {r} did not stop"
            finally:
                os.kill(session, signal.SIGCONT)
        lost, interrupted = lose_1.finish(), interrupt_0.finish()
    # (each error said once; the ring backend's own complaints, written by the same
    # process from another thread, can share its line)
    assert lost.stderr.count("error: ") == 1, lost.stderr
    assert "error: rank 1 is gone (its connection to rank 0 closed)" in lost.stderr
    assert "Node with rank 0 exited with code 1" in lost.stderr, lost.stderr
    assert lost.stdout.strip()  # rank 0's answer so far came out
    assert interrupted.stderr.count("error: ") == 1, interrupted.stderr
    assert "error: rank 0 is gone (its connection to rank 1 closed)" in interrupted.stderr
    assert "interrupted" in interrupted.stderr, interrupted.stderr  # (its line can be shared)
    for line in ("Node with rank 0 exited with code 130", "Node with rank 1 exited with code 1"):
        assert line in interrupted.stderr, interrupted.stderr
    for run in (lost, interrupted):
        assert "Traceback" not in run.stderr and "was killed" not in run.stderr, run.stderr


def test_broadcast_carries_arrays_and_objects():
    """A group of one (no launcher): the request's parts come back as they went."""
    group = mx.distributed.init()
    state = MRopeState(mx.array([[0, 1, 2], [0, 1, 1], [0, 1, 2]], dtype=mx.int32), -1)
    sent = {"ids": mx.array([[5, 6, 7]]), "embeddings": mx.ones((1, 3, 4), dtype=mx.bfloat16),
            "state": state, "mask": mx.array([True, False])}
    got = broadcast_object(sent, group)
    assert got["state"].rope_delta == -1
    assert mx.array_equal(got["state"].position_ids, state.position_ids).item()
    assert got["embeddings"].dtype == mx.bfloat16


def test_plan_says_what_a_rank_holds():
    group = mx.distributed.init()
    assert ShardPlan(group, "pipeline", (14, 28), 28).describe().startswith(
        "rank 0: layers 14-27 of 28 (pipeline over 1 ranks)")
