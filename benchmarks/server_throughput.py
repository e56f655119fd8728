"""Aggregate decode throughput of the server: N concurrent streams against one.

    python benchmarks/server_throughput.py --model benchmarks/checkpoints/smolvlm-256m-bf16
    python benchmarks/server_throughput.py --model PATH --streams 8 --max-tokens 64 --runs 3

Starts ``mlxvlm.server`` in this process (uvicorn on 127.0.0.1, a free port), then, for
each run, sends one streaming request alone and then ``--streams`` streaming requests at
once (different prompts, greedy, ``--max-tokens`` each, prefix reuse off so every stream
does its own prefill). Decode throughput is the tokens that arrive after each stream's
first token, divided by the time from the first of those first tokens to the last token
of any stream; the prefills of streams admitted later fall inside that window, as they do
on a busy server. Prints each run and the median ratio; ``--output`` writes JSON.

Use a checkpoint whose greedy decoding does not stop early (the benchmark checkpoints zero
the end-of-sequence logits); the counts come from the streams, so early stops are only
less work, not wrong numbers.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE / "checkpoints" / "smolvlm-256m-bf16"


def start_server(model_path: str, streams: int):
    import uvicorn

    import mlxvlm
    from mlxvlm.server import ServerConfig, create_app

    model, processor = mlxvlm.load(model_path)
    config = ServerConfig(model_id="bench", max_concurrency=streams, max_queue=streams,
                          prompt_cache_size=0, max_tokens=4096)
    app = create_app(model, processor, config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def stream_once(base_url: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival times of the chunks that carry generated tokens."""
    body = {"model": "bench", "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}], "logprobs": True}
    times = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                      timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0] if chunk["choices"] else None
            # One logprobs entry per generated token, even when its text is held back.
            if choice and choice.get("logprobs"):
                now = time.perf_counter()
                times.extend(now for _ in choice["logprobs"]["content"])
    return times


def decode_rate(streams: list[list[float]]) -> tuple[float, int]:
    """Tokens after each stream's first, per second of the shared decode window."""
    start = min(times[0] for times in streams)
    end = max(times[-1] for times in streams)
    tokens = sum(len(times) - 1 for times in streams)
    return tokens / (end - start), tokens


def run_streams(base_url: str, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    results: list[list[float]] = [[] for _ in prompts]
    barrier = threading.Barrier(len(prompts))

    def worker(index: int) -> None:
        barrier.wait()
        results[index] = stream_once(base_url, prompts[index], max_tokens)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if any(len(times) < 2 for times in results):
        raise RuntimeError("a stream produced fewer than 2 tokens; use a larger --max-tokens "
                           "or a checkpoint that does not stop early")
    return decode_rate(results)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL),
                        help="checkpoint directory (default: the SmolVLM-256M-shaped one)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    if not Path(args.model).exists():
        print(f"error: no checkpoint at {args.model}; build it with "
              "python benchmarks/checkpoints.py or pass --model", file=sys.stderr)
        return 2

    server, thread, base_url = start_server(args.model, args.streams)
    prompts = [f"Describe picture number {i} in detail, please." for i in range(args.streams)]
    try:
        stream_once(base_url, "Warm up.", 8)
        runs = []
        for run in range(args.runs):
            single, _ = run_streams(base_url, prompts[:1], args.max_tokens)
            many, tokens = run_streams(base_url, prompts, args.max_tokens)
            runs.append({"single_tps": single, "aggregate_tps": many, "tokens": tokens,
                         "ratio": many / single})
            print(f"run {run + 1}: 1 stream {single:.1f} tok/s, {args.streams} streams "
                  f"{many:.1f} tok/s aggregate ({tokens} tokens): {many / single:.2f}x",
                  flush=True)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    ratio = statistics.median(r["ratio"] for r in runs)
    print(f"median ratio ({args.streams} streams / 1 stream): {ratio:.2f}x")
    if args.output:
        Path(args.output).write_text(json.dumps(
            {"model": args.model, "streams": args.streams, "max_tokens": args.max_tokens,
             "runs": runs, "median_ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
