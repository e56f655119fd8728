"""Sharded inference on one machine: 1 rank against 2 (tensor and pipeline), over the
ring backend on loopback.

    python benchmarks/checkpoints.py --only qwen2vl-mid --no-quantized
    python benchmarks/distributed.py --checkpoint qwen2vl-mid-bf16 [--max-tokens 64]

Each configuration runs in fresh processes (``mlx.launch --backend ring --hosts
127.0.0.1 -n 2`` for two ranks). It reports prompt and decode tokens/s (rank 0's), every
rank's peak memory and the bytes of the weights it holds (against one process's), and
what communication costs per decoded token: the collectives a token's pass makes (tensor:
two all-reduces of one hidden state per layer; pipeline: a send/receive per stage and the
all-gather of the last stage's states; both: rank 0's token to the others), timed alone,
in a loop, on the same group, and the bytes each rank sends for them. Two ranks on one
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


def communication_bytes(plan, hidden: int, itemsize: int = 4) -> int:
    """Bytes one rank sends per decoded token: a ring all-reduce of n bytes over N ranks
    sends 2(N-1)/N n per rank (an all-gather (N-1)/N of the gathered bytes); a pipeline
    stage's send is one hidden state."""
    n, size = hidden * itemsize, plan.size
    token = 2 * (size - 1) * 4 // size  # rank 0's token, an int32 all-sum
    if plan.mode == "tensor":
        return 2 * plan.num_layers * 2 * (size - 1) * n // size + token
    send = n if plan.rank != 0 else 0
    return send + (size - 1) * n + token


def weight_bytes(model) -> tuple[int, int]:
    """Bytes of the parameters this process holds: the language model's, the rest's."""
    from mlx.utils import tree_flatten

    text = rest = 0
    for name, value in tree_flatten(model.parameters()):
        if ".language_model." in f".{name}":
            text += value.nbytes
        else:
            rest += value.nbytes
    return text, rest


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
    row["text_weights_gb"], row["tower_weights_gb"] = (b / 1e9 for b in weight_bytes(model))
    if plan is not None:
        hidden = model.language_model.model.embed_tokens.weight.shape[1]
        row["communication_ms"] = communication_ms(model, plan.group, hidden)
        row["communication_bytes"] = communication_bytes(plan, hidden)
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
    """Per rank (rank 0 / rank 1): peak memory and the language model's weights, each
    also as a share of one process's; rank 0's speed and communication per token."""
    alone = next(r for r in rows[0] if r["rank"] == 0)
    lines = ["| ranks | mode | prompt tok/s | decode tok/s | peak memory per rank, GB "
             "(share of 1 process) | text weights per rank, GB (share) | towers on rank 0, GB "
             "| communication per token: ms, bytes sent per rank |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for ranks in rows:
        ranks = sorted(ranks, key=lambda r: r["rank"])
        lead = ranks[0]
        memory = " / ".join(f"{r['peak_memory_gb']:.3f} ({r['peak_memory_gb'] / alone['peak_memory_gb']:.0%})"
                            for r in ranks)
        text = " / ".join(f"{r['text_weights_gb']:.3f} ({r['text_weights_gb'] / alone['text_weights_gb']:.0%})"
                          for r in ranks)
        comm = lead.get("communication_ms")
        sent = " / ".join(str(r["communication_bytes"]) for r in ranks if "communication_bytes" in r)
        mode = lead["mode"] if lead["ranks"] > 1 else "-"
        lines.append(f"| {lead['ranks']} | {mode} | {lead['prompt_tps']:.1f} | "
                     f"{lead['generation_tps']:.1f} | {memory} | {text} | "
                     f"{lead['tower_weights_gb']:.3f} | "
                     f"{'-' if comm is None else f'{comm:.2f} ms, {sent} B'} |")
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
