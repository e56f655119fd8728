"""Aggregate decode throughput of the server: N concurrent streams against one.

    python benchmarks/server_throughput.py --model benchmarks/checkpoints/smolvlm-256m-bf16
    python benchmarks/server_throughput.py --model PATH --streams 8 --max-tokens 64 --runs 3

Starts ``mlxvlm.server`` in this process (uvicorn on 127.0.0.1, a free port), then, for
each run, sends one streaming request alone and then ``--streams`` streaming requests at
once (different prompts, greedy, ``--max-tokens`` each, prefix reuse off so every stream
does its own prefill). Decode throughput is the tokens that arrive after each stream's
first token, divided by the time from the first of those first tokens to the last token
of any stream; the prefills of streams admitted later fall inside that window, as they do
on a busy server. It also reports the steady rate, while all streams decode at once.
Prints each run and the median ratios; ``--output`` writes JSON.

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
    import mlxvlm
    from mlxvlm.server import ServerConfig, create_app

    model, processor = mlxvlm.load(model_path)
    config = ServerConfig(model_id="bench", max_concurrency=streams, max_queue=streams,
                          prompt_cache_size=0, max_tokens=4096)
    return serve(create_app(model, processor, config))


def serve(app):
    """uvicorn on 127.0.0.1 and a free port, in a thread: (server, thread, base URL)."""
    import uvicorn

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
    """Arrival times of the generated tokens: of each chunk with text, and the count of
    tokens from the usage chunk (a token whose text is held back, e.g. part of a
    character, sends no chunk of its own; it is counted at the next chunk)."""
    body = {"model": "bench", "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}],
            "stream_options": {"include_usage": True}}
    arrivals, total = [], 0
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                      timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                total = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    # Spread the held-back tokens' count over the chunks that carried them.
    missing = max(total - len(arrivals), 0)
    return arrivals + [arrivals[-1]] * missing if arrivals else []


def decode_rate(streams: list[list[float]]) -> tuple[float, int]:
    """Tokens after each stream's first, per second of the shared decode window."""
    start = min(times[0] for times in streams)
    end = max(times[-1] for times in streams)
    tokens = sum(len(times) - 1 for times in streams)
    return tokens / (end - start), tokens


def steady_rate(streams: list[list[float]]) -> float | None:
    """Tokens per second while every stream is decoding: from the last stream's first
    token to the first stream's last one (None if the streams never all overlapped)."""
    start = max(times[0] for times in streams)
    end = min(times[-1] for times in streams)
    if end <= start:
        return None
    tokens = sum(sum(1 for t in times if start < t <= end) for times in streams)
    return tokens / (end - start)


def run_streams(base_url: str, prompts: list[str], max_tokens: int
                ) -> tuple[float, int, float | None]:
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
    return (*decode_rate(results), steady_rate(results))


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
            single, _, _ = run_streams(base_url, prompts[:1], args.max_tokens)
            many, tokens, steady = run_streams(base_url, prompts, args.max_tokens)
            runs.append({"single_tps": single, "aggregate_tps": many, "tokens": tokens,
                         "ratio": many / single, "steady_tps": steady,
                         "steady_ratio": steady / single if steady else None})
            steady_text = (f"; {steady:.1f} tok/s while all decode: {steady / single:.2f}x"
                           if steady else "")
            print(f"run {run + 1}: 1 stream {single:.1f} tok/s, {args.streams} streams "
                  f"{many:.1f} tok/s aggregate ({tokens} tokens): {many / single:.2f}x"
                  f"{steady_text}", flush=True)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    ratio = statistics.median(r["ratio"] for r in runs)
    print(f"median ratio ({args.streams} streams / 1 stream): {ratio:.2f}x")
    steady = [r["steady_ratio"] for r in runs if r["steady_ratio"]]
    if steady:
        print(f"median ratio while all {args.streams} streams decode: "
              f"{statistics.median(steady):.2f}x")
    if args.output:
        Path(args.output).write_text(json.dumps(
            {"model": args.model, "streams": args.streams, "max_tokens": args.max_tokens,
             "runs": runs, "median_ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
