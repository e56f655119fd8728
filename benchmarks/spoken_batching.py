"""Spoken answers beside other requests on ``python -m mlxvlm.server``: several streamed
spoken chat answers and one streamed text answer sent at once, for one or more source
trees of mlxvlm (e.g. before and after spoken answers became rows of the batching
engine), alternating tree by tree, run by run.

    python benchmarks/spoken_batching.py --model PATH --tree base=/tmp/base --tree new=.
    python benchmarks/spoken_batching.py --model PATH --tree new=. --spoken 2 --runs 3 \
        --max-tokens 48 --frames 96 --text-tokens 256 --output r.json

Each run starts the tree's server (``PYTHONPATH=TREE``, a free port, the one model), sends
one warm-up spoken answer, then ``--spoken`` spoken answers (greedy thinker and talker,
``--max-tokens`` tokens, ``--frames`` talker frames) and a text answer (``--text-tokens``)
at once, each streamed, and records from the send: each request's first text delta, its
last text delta, its first audio delta and its end; the run's wall time; the server's
peak decode batch (``/metrics``). The load average is written beside each run (the
machine may be shared). Every tree must make the same text and audio (greedy): the
benchmark checks it.

With ``--together-vs-one-by-one`` (one tree), one server sends ``--spoken`` spoken answers
at once and the same answers one after another, alternating which goes first run by run,
and records each answer's first text delta, first audio delta, last text delta and end
from its own send, and the wall time of all; each answer sent at once must make the same
text and audio as when sent alone (greedy). ``--ignore-eos`` puts a logit bias of -100 on
the checkpoint's end-of-answer ids, so that a random checkpoint writes ``--max-tokens``::

    flock /work/notes/bigmem.lock python benchmarks/spoken_batching.py --model REAL \
        --tree new=. --together-vs-one-by-one --spoken 2 --runs 2 --max-tokens 24 \
        --frames 32 --ignore-eos --output r.json

``results/2026-12-06-intel-xeon-2c/spoken-batching-tiny.json`` was taken on the tests'
tiny random checkpoint (``tests/tiny/qwen3_omni_speech.py``, seed 2, saved in the Hub's
layout): at its widths every step is overhead, so it shows how the requests wait for one
another (whether a text answer's decoding pauses while an answer is spoken, whether
spoken answers run one after the other), not what a real model's seconds are.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PROMPTS = ["Describe a red circle.", "Describe a blue square.", "Describe a green triangle.",
           "Describe a yellow star."]
TEXT_PROMPT = "Count to many."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tree: str, model: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tree = str(Path(tree).resolve())
        # run from the tree: ``-m`` puts the working directory first on the path
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlxvlm.server", "--model", str(Path(model).resolve()),
             "--port", str(self.port)],
            env={**os.environ, "PYTHONPATH": tree}, cwd=tree, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server of {tree} exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"the server of {tree} did not start")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)

    def peak_batch(self) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("mlxvlm_peak_batch_size"):
                return float(line.split()[-1])
        raise RuntimeError("no mlxvlm_peak_batch_size in /metrics")


def eos_ids(model: str) -> list[int]:
    """The ids that end an answer: every ``eos_token_id`` of config.json and
    generation_config.json, and the tokenizer's end token (as ``mlxvlm.load`` gathers
    them)."""
    found: set[int] = set()

    def walk(value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "eos_token_id" and item is not None:
                    found.update(item if isinstance(item, list) else [item])
                else:
                    walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    root = Path(model)
    for name in ("config.json", "generation_config.json"):
        if (root / name).exists():
            walk(json.loads((root / name).read_text()))
    eos = json.loads((root / "tokenizer_config.json").read_text()).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    for token in json.loads((root / "tokenizer.json").read_text()).get("added_tokens", []):
        if token["content"] == eos:
            found.add(token["id"])
    return sorted(found)


def streamed(url: str, model: str, prompt: str, max_tokens: int, frames: int | None,
             start: float, logit_bias: dict | None = None) -> dict:
    """One streamed chat answer through the official ``openai`` client (spoken unless
    ``frames`` is None): its event times from ``start`` and from its own send, its text
    and audio."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           timeout=1800.0)
    options: dict = {"extra_body": {}}
    if frames is not None:
        options = dict(modalities=["text", "audio"], audio={"format": "pcm16"},
                       extra_body={"talker_temperature": 0, "talker_max_frames": frames})
    if logit_bias:
        options["logit_bias"] = logit_bias
    text, audio = [], []
    first_text = last_text = first_audio = None
    sent = time.perf_counter() - start
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, **options)
    for event in stream:
        if not event.choices:
            continue
        delta = event.choices[0].delta
        now = time.perf_counter() - start
        if delta.content:
            text.append(delta.content)
            first_text = first_text if first_text is not None else now
            last_text = now
        audio_delta = getattr(delta, "audio", None) or {}
        if not isinstance(audio_delta, dict):  # the client's model of an extra field
            audio_delta = audio_delta.model_dump(exclude_none=True)
        data = audio_delta.get("data")
        if data:
            audio.append(base64.b64decode(data))
            first_audio = first_audio if first_audio is not None else now
    end = time.perf_counter() - start
    own = {f"own_{k}": (v - sent if v is not None else None) for k, v in
           dict(first_text_s=first_text, last_text_s=last_text, first_audio_s=first_audio,
                end_s=end).items()}
    return dict(sent_s=sent, first_text_s=first_text, last_text_s=last_text,
                first_audio_s=first_audio, end_s=end, **own, text="".join(text),
                audio_bytes=len(b"".join(audio)), audio=b"".join(audio))


def at_once(calls: list) -> list:
    """Each ``call(start)`` on a thread of its own, all let go together (``start``: the
    perf_counter time they were let go); their results, None for one that raised."""
    results: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls) + 1)
    start_box: list[float] = []

    def run(i: int) -> None:
        barrier.wait()
        results[i] = calls[i](start_box[0])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    start_box.append(time.perf_counter())
    barrier.wait()
    for thread in threads:
        thread.join()
    return results


def one_run(server: Server, model: str, args, bias: dict | None) -> dict:
    spoken = [PROMPTS[i % len(PROMPTS)] for i in range(args.spoken)]
    calls = [lambda start, prompt=prompt: streamed(server.url, model, prompt, args.max_tokens,
                                                   args.frames, start, bias)
             for prompt in spoken]
    calls.append(lambda start: streamed(server.url, model, TEXT_PROMPT, args.text_tokens,
                                        None, start, bias))
    results = at_once(calls)
    wall = max(r["end_s"] for r in results)
    return dict(load_average=os.getloadavg(), wall_s=wall, peak_batch=server.peak_batch(),
                spoken=results[:-1], text=results[-1])


def spoken_together(server: Server, model: str, args, bias: dict | None) -> list[dict]:
    """``--spoken`` spoken answers sent at once."""
    results = at_once([lambda start, i=i: streamed(server.url, model, PROMPTS[i % len(PROMPTS)],
                                                   args.max_tokens, args.frames, start, bias)
                       for i in range(args.spoken)])
    if any(r is None for r in results):
        raise RuntimeError("a spoken answer sent at once failed (see above)")
    return results


def spoken_one_by_one(server: Server, model: str, args, bias: dict | None) -> list[dict]:
    """The same spoken answers, each sent when the one before has ended."""
    start = time.perf_counter()
    return [streamed(server.url, model, PROMPTS[i % len(PROMPTS)], args.max_tokens,
                     args.frames, start, bias) for i in range(args.spoken)]


def together_vs_one_by_one(args, tree: str, bias: dict | None) -> dict:
    """One server; per run both orders, alternating which goes first run by run. Each
    answer sent at once must say what its twin sent alone says (greedy)."""
    runs: dict[str, list] = {"together": [], "one_by_one": []}
    modes = {"together": spoken_together, "one_by_one": spoken_one_by_one}
    reference = None
    server = Server(tree, args.model)
    try:
        streamed(server.url, args.model, PROMPTS[0], 4, 4, time.perf_counter(), bias)
        for run in range(args.runs):
            order = ["together", "one_by_one"] if run % 2 == 0 else ["one_by_one", "together"]
            for name in order:
                load_before = os.getloadavg()
                answers = modes[name](server, args.model, args, bias)
                made = [(a["text"], a["audio"]) for a in answers]
                reference = reference or made
                for i, (mine, twin) in enumerate(zip(made, reference)):
                    if mine != twin:
                        raise RuntimeError(
                            f"run {run + 1} {name}: answer {i} made other "
                            f"{'text' if mine[0] != twin[0] else 'audio'} than in the first "
                            f"run ({len(mine[1])} against {len(twin[1])} audio bytes)")
                for a in answers:
                    del a["audio"]
                result = dict(load_average_before=load_before, load_average=os.getloadavg(),
                              wall_s=max(a["end_s"] for a in answers), spoken=answers)
                runs[name].append(result)
                print(f"run {run + 1} {name}: wall {result['wall_s']:.2f} s; answers "
                      + "; ".join(f"first token {a['own_first_text_s']:.2f}, first audio "
                                  f"{a['own_first_audio_s']:.2f}, text done "
                                  f"{a['own_last_text_s']:.2f}, audio done "
                                  f"{a['own_end_s']:.2f} s ({a['audio_bytes']} B)"
                                  for a in answers)
                      + f"; load {load_before[0]:.2f}-{result['load_average'][0]:.2f}",
                      flush=True)
        peak = server.peak_batch()
    finally:
        server.close()
    summary = {}
    for name, results in runs.items():
        summary[name] = dict(wall_s=statistics.median(r["wall_s"] for r in results), **{
            f"answer{i}_{key}": statistics.median(r["spoken"][i][f"own_{key}"] for r in results)
            for i in range(args.spoken)
            for key in ("first_text_s", "first_audio_s", "last_text_s", "end_s")})
        print(name, "medians (seconds from each answer's own send):",
              json.dumps({k: round(v, 3) for k, v in summary[name].items()}))
    return dict(peak_batch=peak, summary=summary, runs=runs,
                same_text_and_audio_as_sent_alone=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a full (speaking) Qwen3-Omni checkpoint")
    parser.add_argument("--tree", action="append", required=True,
                        help="NAME=DIR: a source tree of mlxvlm to serve with (repeat)")
    parser.add_argument("--spoken", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--frames", type=int, default=96)
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--together-vs-one-by-one", action="store_true",
                        help="one tree, one server: --spoken spoken answers sent at once "
                             "against the same sent one after another (no text answer)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="a logit bias of -100 on the end-of-answer ids, so that a random "
                             "checkpoint writes --max-tokens tokens")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    trees = dict(tree.split("=", 1) for tree in args.tree)
    bias = {str(i): -100 for i in eos_ids(args.model)} if args.ignore_eos else None
    if args.together_vs_one_by_one:
        if len(trees) != 1:
            parser.error("--together-vs-one-by-one serves one --tree")
        result = together_vs_one_by_one(args, next(iter(trees.values())), bias)
        if args.output:
            Path(args.output).write_text(json.dumps(dict(args=vars(args), **result),
                                                    indent=1) + "\n")
        return 0
    runs: dict[str, list] = {name: [] for name in trees}
    reference = None
    for run in range(args.runs):
        for name, tree in trees.items():
            server = Server(tree, args.model)
            try:
                streamed(server.url, args.model, PROMPTS[0], 4, 4, time.perf_counter(), bias)
                result = one_run(server, args.model, args, bias)
            finally:
                server.close()
            made = [(r["text"], r["audio"]) for r in [*result["spoken"], result["text"]]]
            if reference is None:
                reference = made
            if made != reference:
                raise RuntimeError(f"{name} made other text or audio than the first run")
            for r in [*result["spoken"], result["text"]]:
                del r["audio"]
            runs[name].append(result)
            print(f"run {run + 1} {name}: wall {result['wall_s']:.2f} s, peak batch "
                  f"{result['peak_batch']:g}, text done at {result['text']['last_text_s']:.2f} s, "
                  "spoken done at "
                  + ", ".join(f"{r['end_s']:.2f}" for r in result["spoken"])
                  + f" s; load {result['load_average'][0]:.2f}", flush=True)
    summary = {}
    for name, results in runs.items():
        summary[name] = dict(
            wall_s=statistics.median(r["wall_s"] for r in results),
            text_done_s=statistics.median(r["text"]["last_text_s"] for r in results),
            text_first_token_s=statistics.median(r["text"]["first_text_s"] for r in results),
            spoken_first_audio_s=statistics.median(
                max(s["first_audio_s"] for s in r["spoken"]) for r in results),
            spoken_done_s=statistics.median(max(s["end_s"] for s in r["spoken"])
                                            for r in results))
        print(name, "medians:", json.dumps({k: round(v, 3) for k, v in summary[name].items()}))
    if args.output:
        Path(args.output).write_text(json.dumps(
            dict(args=vars(args), summary=summary, runs=runs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
