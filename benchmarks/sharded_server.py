"""The sharded server's batch: 1 stream against 4, in one process and on two ranks of
this machine over loopback (``mlx.launch --backend ring --hosts 127.0.0.1 -n 2``).

    python benchmarks/checkpoints.py --only qwen2vl-small --no-quantized
    python benchmarks/sharded_server.py [--checkpoint qwen2vl-small-bf16] [--runs 2]

Each configuration -- one process, two ranks tensor-parallel, two ranks pipelined --
starts ``python -m mlxvlm.server`` as a user does (prefix reuse off, so every stream
does its own prefill), warms it up, then per run sends one streaming request alone and
``--streams`` at once (``server_throughput.run_streams``: decode tokens/s over the
shared window, and while all streams decode). Before the batching sharded server, the
two-rank rows' 4-stream rate could only equal their 1-stream rate (one request at a
time); the ratio says how much of one weight read four rows now share. Two ranks on one
machine share its cores and memory bandwidth: the figures say what sharding and its
per-pass broadcast cost here, not what a second machine gains.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from server_throughput import run_streams, stream_once

LAUNCH = Path(sys.executable).parent / "mlx.launch"
CONFIGURATIONS = {"1 process": [], "2 ranks tensor": ["tensor"],
                  "2 ranks pipeline": ["pipeline"]}


def free_port() -> int:
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:  # the ring backend takes this port and the next
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def server_command(checkpoint: Path, mode: list[str], port: int, streams: int) -> list[str]:
    serve = ["-m", "mlxvlm.server", "--model", str(checkpoint), "--served-model-name",
             "bench", "--port", str(port), "--max-concurrency", str(streams),
             "--prompt-cache-size", "0", "--max-tokens", "4096"]
    if not mode:
        return [sys.executable, *serve]
    pipeline = ["--pipeline"] if mode == ["pipeline"] else []
    return [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
            "--starting-port", str(free_port()), "--env",
            f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", "--python", sys.executable,
            "--", *serve, *pipeline]


def measure(name: str, checkpoint: Path, streams: int, max_tokens: int, runs: int) -> dict:
    port = free_port()
    log_path = Path(tempfile.mkdtemp()) / "server.log"
    with log_path.open("w") as log:  # (the server writes on after this closes it here)
        server = subprocess.Popen(server_command(checkpoint, CONFIGURATIONS[name], port,
                                                 streams),
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    prompts = [f"Describe picture number {i} in detail, please." for i in range(streams)]
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the server did not start:\n"
                                   + log_path.read_text())
            time.sleep(0.5)
        stream_once(base, "Warm up.", 8)
        rows = []
        for run in range(runs):
            single, _, _ = run_streams(base, prompts[:1], max_tokens)
            many, tokens, steady = run_streams(base, prompts, max_tokens)
            rows.append({"single_tps": single, "aggregate_tps": many, "tokens": tokens,
                         "steady_tps": steady})
            print(f"{name}, run {run + 1}: 1 stream {single:.1f} tok/s, {streams} streams "
                  f"{many:.1f} tok/s ({many / single:.2f}x)", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
    return {"configuration": name, "runs": rows,
            "single_tps": statistics.median(r["single_tps"] for r in rows),
            "aggregate_tps": statistics.median(r["aggregate_tps"] for r in rows)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="qwen2vl-small-bf16",
                        help="a directory under benchmarks/checkpoints/, or a path")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--configurations", nargs="+", default=list(CONFIGURATIONS),
                        choices=list(CONFIGURATIONS))
    parser.add_argument("--output", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        checkpoint = HERE / "checkpoints" / args.checkpoint
    if not checkpoint.exists():
        print(f"error: no checkpoint {args.checkpoint}; build it with python "
              "benchmarks/checkpoints.py --only qwen2vl-small --no-quantized", file=sys.stderr)
        return 2
    results = [measure(name, checkpoint, args.streams, args.max_tokens, args.runs)
               for name in args.configurations]
    print(f"\n| configuration | 1 stream tok/s | {args.streams} streams tok/s | ratio |")
    print("| --- | --- | --- | --- |")
    for row in results:
        print(f"| {row['configuration']} | {row['single_tps']:.1f} | "
              f"{row['aggregate_tps']:.1f} | {row['aggregate_tps'] / row['single_tps']:.2f}x |")
    if args.output:
        Path(args.output).write_text(json.dumps(
            {"checkpoint": str(checkpoint), "streams": args.streams,
             "max_tokens": args.max_tokens, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
