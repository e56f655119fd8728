"""One batched decode step of the batching engine, in-process: B rows against one.

    python benchmarks/batched_step.py --model benchmarks/checkpoints/smolvlm-256m-bf16
    python benchmarks/batched_step.py --batch 1 8 --steps 32 --rounds 3 --output out.json

Prefills ``max(--batch)`` text prompts of different lengths (so the batched caches carry
left padding, as the server's do), joins them into the engine's ``DecodeBatch`` (mlx-lm's
batched KV caches) and times ``DecodeBatch.step`` followed by reading the tokens, which
is what the engine does per step, without HTTP, tokenization or the engine's thread. Per
batch size: the median wall time of a step and the process's CPU time per step (steadier
on a shared machine: time the process waits for a core is not in it), the tokens per
second they give, and their ratio to one row's. The batch sizes alternate round by round.
Greedy; the tokens themselves are not read for anything but the timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE / "checkpoints" / "smolvlm-256m-bf16"


def prefilled_batch(model, rows: int):
    """A DecodeBatch of ``rows`` greedy rows, each prompt 7 tokens longer than the last."""
    import mlx.core as mx

    from mlxvlm.batching.decode import DecodeBatch
    from mlxvlm.generate.loop import generation_stream
    from mlxvlm.sampling import RowSampler, SamplingOptions, sampling_step

    batch = DecodeBatch(model, merged=True)
    for i in range(rows):
        ids = mx.array([[5 + j for j in range(20 + 7 * i)]])
        cache = model.make_cache()
        with mx.stream(generation_stream):
            embeddings, state = model.embed(ids)
            logits = model(ids, cache, embeddings=embeddings, state=state, last_only=True)
            row = RowSampler(SamplingOptions(), ids[0])
            tokens, logprobs = sampling_step(logits[:, -1, :], [row])
            mx.eval(tokens, logprobs)
        batch.join(types.SimpleNamespace(row=row, state=state), cache, state, tokens, logprobs)
    return batch


def time_steps(batch, steps: int, warmup: int = 3) -> tuple[float, float]:
    """Median wall seconds and mean process CPU seconds of one step (step + read)."""
    for _ in range(warmup):
        batch.step()
        batch.tokens.tolist()
    walls = []
    cpu_start = time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        batch.step()
        batch.tokens.tolist()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), (time.process_time() - cpu_start) / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    if not Path(args.model).exists():
        print(f"error: no checkpoint at {args.model}; build it with "
              "python benchmarks/checkpoints.py or pass --model", file=sys.stderr)
        return 2
    import mlxvlm

    model, _ = mlxvlm.load(args.model)
    runs = []
    for round_ in range(args.rounds):
        for rows in args.batch:
            wall, cpu = time_steps(prefilled_batch(model, rows), args.steps)
            load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
            runs.append({"round": round_, "batch": rows, "wall_ms": wall * 1e3,
                         "cpu_ms": cpu * 1e3, "loadavg": load})
            print(f"round {round_ + 1}, {rows} rows: {wall * 1e3:.1f} ms a step "
                  f"({rows / wall:.1f} tokens/s), {cpu * 1e3:.1f} ms CPU "
                  f"({rows / cpu:.1f} tokens per CPU-second); load {load}", flush=True)
    summary = {}
    for rows in args.batch:
        mine = [r for r in runs if r["batch"] == rows]
        summary[rows] = {key: statistics.median(r[key] for r in mine) for key in ("wall_ms", "cpu_ms")}
    one = summary.get(1)
    for rows, figures in summary.items():
        ratio = (f"; {rows * one['wall_ms'] / figures['wall_ms']:.2f}x one row's tokens/s "
                 f"(CPU time: {rows * one['cpu_ms'] / figures['cpu_ms']:.2f}x)") if one else ""
        print(f"median, {rows} rows: {figures['wall_ms']:.1f} ms a step, "
              f"{figures['cpu_ms']:.1f} ms CPU{ratio}")
    if args.output:
        Path(args.output).write_text(json.dumps(
            {"model": args.model, "steps": args.steps, "runs": runs,
             "median": {str(k): v for k, v in summary.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
