"""Sharded inference on one machine: 1 rank against 2 (tensor and pipeline), over the
ring backend on loopback.

    python benchmarks/checkpoints.py --only qwen2vl-mid --no-quantized
    python benchmarks/distributed.py --checkpoint qwen2vl-mid-bf16 [--max-tokens 64]

Each configuration runs in fresh processes (``mlx.launch --backend ring --hosts
127.0.0.1 -n 2`` for two ranks). It reports prompt and decode tokens/s (rank 0's), every
rank's peak memory, and what communication costs per decoded token: the collectives a
token's pass makes (tensor: two all-reduces of one hidden state per layer; pipeline: a
send/receive per stage and the all-gather of the last stage's states; both: rank 0's
token to the others), timed alone, in a loop, on the same group. Two ranks on one
machine share its cores and memory bandwidth: the figures say what the sharding costs,
not what two Macs gain (there each rank has its own).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAUNCH = Path(sys.executable).parent / "mlx.launch"


def communication_ms(model, group, hidden: int, repeats: int = 50) -> float:
    """Milliseconds of one decoded token's collectives, run alone."""
    import mlx.core as mx

    plan = model.sharding
    state = mx.zeros((1, 1, hidden))
    token = mx.array([1], dtype=mx.uint32)

    def one_token():
        outputs = []
        if plan.mode == "tensor":
            for _ in range(2 * plan.num_layers):
                outputs.append(mx.distributed.all_sum(state, group=group))
        else:
            rank, size = plan.rank, plan.size
            h = state
            if rank < size - 1:
                h = mx.distributed.recv_like(h, rank + 1, group=group)
            if rank != 0:
                h = mx.distributed.send(h, rank - 1, group=group)
            outputs.append(mx.distributed.all_gather(h, group=group))
        outputs.append(mx.distributed.all_sum(token, group=group, stream=mx.cpu))
        mx.eval(outputs)

    one_token()
    start = time.perf_counter()
    for _ in range(repeats):
        one_token()
    return (time.perf_counter() - start) / repeats * 1000


def measure(checkpoint: str, mode: str, max_tokens: int) -> None:
    """One configuration, in this process (a rank of a launch, or alone)."""
    import mlxvlm  # noqa: F401  (before mlx.core)
    import mlx.core as mx

    mx.distributed.init()
    from mlxvlm.generate.follower import follow
    from mlxvlm.distributed.jobs import release
    from mlxvlm.generate import stream_generate
    from mlxvlm.checkpoint.loading import load

    settings = json.loads((Path(checkpoint) / "benchmark.json").read_text())
    model, processor = load(checkpoint, shard=mode)
    plan = model.sharding
    rank = 0 if plan is None else plan.rank
    row = {"rank": rank, "ranks": 1 if plan is None else plan.size, "mode": mode}
    if plan is not None and rank != 0:
        follow(model, processor)
    else:
        try:
            last = None
            for last in stream_generate(model, processor, settings["prompt"],
                                        str(Path(checkpoint) / settings["image"]),
                                        max_tokens=max_tokens):
                pass
        finally:
            if plan is not None:
                release(model)
        row.update(prompt_tps=last.prompt_tps, generation_tps=last.generation_tps,
                   tokens=last.generation_tokens)
    if plan is not None:
        hidden = model.language_model.model.embed_tokens.weight.shape[1]
        row["communication_ms"] = communication_ms(model, plan.group, hidden)
    row["peak_memory_gb"] = mx.get_peak_memory() / 1e9
    print(json.dumps(row), flush=True)


def run(checkpoint: Path, ranks: int, mode: str, max_tokens: int) -> list[dict]:
    me = [str(Path(__file__).resolve()), "--checkpoint", str(checkpoint), "--mode", mode,
          "--max-tokens", str(max_tokens), "--rank-process"]
    if ranks == 1:
        command = [sys.executable, *me]
    else:
        command = [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(ranks),
                   "--python", sys.executable, "--", *me]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def table(rows: list[list[dict]]) -> str:
    lines = ["| ranks | mode | prompt tok/s | decode tok/s | peak memory per rank (GB) "
             "| communication per token (ms) |", "| --- | --- | --- | --- | --- | --- |"]
    for ranks in rows:
        lead = next(r for r in ranks if r["rank"] == 0)
        memory = " / ".join(f"{r['peak_memory_gb']:.2f}"
                            for r in sorted(ranks, key=lambda r: r["rank"]))
        comm = lead.get("communication_ms")
        mode = lead["mode"] if lead["ranks"] > 1 else "-"
        lines.append(f"| {lead['ranks']} | {mode} | {lead['prompt_tps']:.1f} | "
                     f"{lead['generation_tps']:.1f} | {memory} | "
                     f"{'-' if comm is None else f'{comm:.2f}'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="qwen2vl-mid-bf16",
                        help="A directory, or a name under benchmarks/checkpoints/ "
                        "(default: qwen2vl-mid-bf16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="Tokens to decode (default: 64)")
    parser.add_argument("--mode", default="tensor", choices=("tensor", "pipeline"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=None, help="Write the raw rows here as JSON")
    args = parser.parse_args()
    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        checkpoint = HERE / "checkpoints" / args.checkpoint
    if args.rank_process:
        measure(str(checkpoint), args.mode, args.max_tokens)
        return 0
    rows = [run(checkpoint, 1, "tensor", args.max_tokens),
            run(checkpoint, 2, "tensor", args.max_tokens),
            run(checkpoint, 2, "pipeline", args.max_tokens)]
    if args.output is not None:
        args.output.write_text(json.dumps(rows, indent=2))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
