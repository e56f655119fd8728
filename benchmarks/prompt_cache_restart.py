"""A returning conversation's first token after a server restart: resumed from the prompt
cache on disk (``--prompt-cache-dir``) against a cold prefill, and the memory tier of a
server that never stopped.

    python benchmarks/prompt_cache_restart.py --model benchmarks/checkpoints/smolvlm-256m-bf16
    python benchmarks/prompt_cache_restart.py --model PATH --words 400 1600 --runs 3

For each conversation length (``--words`` of text in turn 1) and run, each against
``python -m mlxvlm.server`` started as users start it (a subprocess on a free port):

- disk: a server with a fresh ``--prompt-cache-dir`` answers turn 1 and stops; a new
  server on the same folder answers turn 2 (turn 1, its answer, a short question);
- cold: a server without the folder and with ``--prompt-cache-size 0`` answers turn 2;
- memory: one server (no folder) answers turn 1 then turn 2.

It reports turn 2's time to first token (streamed, from sending the request to the first
content chunk) with its prompt and cached tokens, turn 1's whole answer time with and
without the folder (the file is written in the background), and the file's size. Prints
a Markdown table of the medians; ``--output`` writes every run as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE / "checkpoints" / "smolvlm-256m-bf16"


class Server:
    """``python -m mlxvlm.server --model M *flags`` on a free port until the block ends."""

    def __init__(self, model: str, *flags: str):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "mlxvlm.server", "--model", model,
                        "--served-model-name", "bench", "--port", str(self.port),
                        "--log-level", "warning", "--max-tokens", "4096", *flags]

    def __enter__(self) -> "Server":
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL,
                                        stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n"
                                   f"{self.log.read()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not start")

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGINT)  # a clean stop: pending files are written
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def ask(self, messages: list[dict], max_tokens: int) -> dict:
        """Streamed greedily: time to first content, whole time, answer, usage."""
        body = {"model": "bench", "stream": True, "temperature": 0, "max_tokens": max_tokens,
                "messages": messages, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        first, text, usage = None, [], {}
        with httpx.stream("POST", f"{self.base_url}/v1/chat/completions", json=body,
                          timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(chunk["choices"][0]["delta"]["content"])
        ended = time.perf_counter()
        return {"ttft_s": (first or ended) - started, "total_s": ended - started,
                "answer": "".join(text), "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def conversation(words: int) -> tuple[list[dict], callable]:
    # One token a word under the benchmark checkpoints' word-level tokenizers; content as
    # parts, which their chat templates read.
    def said(role: str, text: str) -> dict:
        return {"role": role, "content": [{"type": "text", "text": text}]}

    turn1 = [said("user", " ".join(f"w{i}" for i in range(words)))]

    def turn2(answer: str) -> list[dict]:
        return [*turn1, said("assistant", answer), said("user", "w1 w2 w3 w4 w5 w6 w7 w8")]

    return turn1, turn2


def one_run(model: str, words: int, max_tokens: int) -> dict:
    turn1, turn2 = conversation(words)
    with tempfile.TemporaryDirectory(prefix="mlxvlm-prompt-cache-") as folder:
        with Server(model, "--prompt-cache-dir", folder) as server:
            first_with_disk = server.ask(turn1, max_tokens)
        files = list(Path(folder).glob("*.safetensors"))
        file_bytes = sum(f.stat().st_size for f in files)
        with Server(model, "--prompt-cache-dir", folder) as server:
            disk = server.ask(turn2(first_with_disk["answer"]), max_tokens)
    with Server(model) as server:
        first = server.ask(turn1, max_tokens)
        memory = server.ask(turn2(first["answer"]), max_tokens)
    with Server(model, "--prompt-cache-size", "0") as server:
        cold = server.ask(turn2(first["answer"]), max_tokens)
    if not disk["answer"] == memory["answer"] == cold["answer"]:
        raise RuntimeError("the resumed, memory and cold answers differ")
    return {"words": words, "prompt_tokens": cold["prompt_tokens"],
            "disk": disk, "memory": memory, "cold": cold, "file_bytes": file_bytes,
            "turn1_with_disk_s": first_with_disk["total_s"], "turn1_s": first["total_s"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL),
                        help="checkpoint directory (default: the SmolVLM-256M-shaped one)")
    parser.add_argument("--words", type=int, nargs="+", default=[400, 1600],
                        help="words (one token each) in turn 1, one conversation length each")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    if not Path(args.model).exists():
        print(f"error: no checkpoint at {args.model}; build it with "
              "python benchmarks/checkpoints.py or pass --model", file=sys.stderr)
        return 2
    runs = []
    for words in args.words:
        for run in range(args.runs):
            result = one_run(args.model, words, args.max_tokens)
            runs.append(result)
            print(f"{words} words, run {run + 1}: prompt {result['prompt_tokens']} tokens; "
                  f"first token cold {result['cold']['ttft_s']:.3f} s, from disk "
                  f"{result['disk']['ttft_s']:.3f} s ({result['disk']['cached_tokens']} cached), "
                  f"memory {result['memory']['ttft_s']:.3f} s", flush=True)
    print("\n| turn 2 prompt tokens | cached from disk | first token, cold | from disk after "
          "a restart | from memory | file | turn 1 answer with / without the folder |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for words in args.words:
        mine = [r for r in runs if r["words"] == words]
        med = lambda f: statistics.median(f(r) for r in mine)  # noqa: E731
        print(f"| {mine[0]['prompt_tokens']} | {mine[0]['disk']['cached_tokens']} "
              f"| {med(lambda r: r['cold']['ttft_s']):.3f} s "
              f"| {med(lambda r: r['disk']['ttft_s']):.3f} s "
              f"| {med(lambda r: r['memory']['ttft_s']):.3f} s "
              f"| {med(lambda r: r['file_bytes']) / 2**20:.1f} MiB "
              f"| {med(lambda r: r['turn1_with_disk_s']):.3f} / {med(lambda r: r['turn1_s']):.3f} s |")
    if args.output:
        Path(args.output).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.pop("MLXVLM_ALLOW_TORCH", None)
    sys.exit(main())
