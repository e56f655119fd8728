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


def streamed(url: str, model: str, prompt: str, max_tokens: int, frames: int | None,
             start: float) -> dict:
    """One streamed chat answer (spoken unless ``frames`` is None): its event times from
    ``start``, its text and audio."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if frames is not None:
        body |= {"modalities": ["text", "audio"], "audio": {"format": "pcm16"},
                 "talker_temperature": 0, "talker_max_frames": frames}
    text, audio = [], []
    first_text = last_text = first_audio = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if not event.get("choices"):
                continue
            delta = event["choices"][0]["delta"]
            now = time.perf_counter() - start
            if delta.get("content"):
                text.append(delta["content"])
                first_text = first_text if first_text is not None else now
                last_text = now
            data = (delta.get("audio") or {}).get("data")
            if data:
                audio.append(base64.b64decode(data))
                first_audio = first_audio if first_audio is not None else now
    return dict(first_text_s=first_text, last_text_s=last_text, first_audio_s=first_audio,
                end_s=time.perf_counter() - start, text="".join(text),
                audio_bytes=len(b"".join(audio)), audio=b"".join(audio))


def one_run(server: Server, model: str, args) -> dict:
    spoken = [PROMPTS[i % len(PROMPTS)] for i in range(args.spoken)]
    results: list = [None] * (len(spoken) + 1)
    barrier = threading.Barrier(len(results) + 1)
    start_box: list[float] = []

    def run(i: int) -> None:
        barrier.wait()
        if i < len(spoken):
            results[i] = streamed(server.url, model, spoken[i], args.max_tokens, args.frames,
                                  start_box[0])
        else:
            results[i] = streamed(server.url, model, TEXT_PROMPT, args.text_tokens, None,
                                  start_box[0])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(results))]
    for thread in threads:
        thread.start()
    start_box.append(time.perf_counter())
    barrier.wait()
    for thread in threads:
        thread.join()
    wall = max(r["end_s"] for r in results)
    return dict(load_average=os.getloadavg(), wall_s=wall, peak_batch=server.peak_batch(),
                spoken=results[:-1], text=results[-1])


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
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    trees = dict(tree.split("=", 1) for tree in args.tree)
    runs: dict[str, list] = {name: [] for name in trees}
    reference = None
    for run in range(args.runs):
        for name, tree in trees.items():
            server = Server(tree, args.model)
            try:
                streamed(server.url, args.model, PROMPTS[0], 4, 4, time.perf_counter())
                result = one_run(server, args.model, args)
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
