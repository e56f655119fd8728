"""One prefill product with bf16 weights: mlxvlm's (16-bit weights, float32 arithmetic)
against PyTorch's bf16 and float32 ``F.linear``, alternating in one process.

    python benchmarks/half_product.py                      # GLM-4.6V-Flash's MLP, 344 rows
    python benchmarks/half_product.py --rows 1601 --k 1280 --n 5120 --output out.json

Where transformers bf16 reaches its first token sooner than mlxvlm, this says whether the
matrix products are why: PyTorch's bf16 products go through oneDNN, which uses AMX tiles
on CPUs that have them (Intel Sapphire Rapids and later), while mlxvlm computes in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=344, help="Tokens in the prefill")
    parser.add_argument("--k", type=int, default=4096, help="Input width")
    parser.add_argument("--n", type=int, default=13696, help="Output width")
    parser.add_argument("--rounds", type=int, default=6, help="The first is a warm-up")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    import mlxvlm  # noqa: F401  (first: it sets up the CPU backend before MLX loads)
    import mlx.core as mx
    import numpy as np
    import torch
    from mlxvlm.cpu import kernels

    weight = (mx.random.normal((args.n, args.k), key=mx.random.key(0)) * 0.02).astype(mx.bfloat16)
    x = mx.random.normal((args.rows, args.k), key=mx.random.key(1))
    mx.eval(weight, x)
    torch_weight = torch.from_numpy(np.array(weight.astype(mx.float32))).to(torch.bfloat16)
    torch_weight32 = torch_weight.float()
    torch_x = torch.from_numpy(np.array(x))
    variants = {
        "mlxvlm (bf16 weights, float32 arithmetic)":
            lambda: mx.eval(kernels.half_linear(x, weight, None)),
        "torch bf16": lambda: torch.nn.functional.linear(torch_x.bfloat16(), torch_weight),
        "torch float32": lambda: torch.nn.functional.linear(torch_x, torch_weight32),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    load = [os.getloadavg()]
    for _ in range(args.rounds):
        for name, product in variants.items():
            start = time.perf_counter()
            product()
            times[name].append(time.perf_counter() - start)
    load.append(os.getloadavg())
    flop = 2 * args.rows * args.k * args.n
    report = {"shape": [args.rows, args.k, args.n], "torch_threads": torch.get_num_threads(),
              "load_average": load, "seconds": times}
    for name, seconds in times.items():
        median = statistics.median(seconds[1:])
        print(f"{name}: {median * 1e3:.0f} ms ({min(seconds[1:]) * 1e3:.0f}–"
              f"{max(seconds[1:]) * 1e3:.0f}), {flop / median / 1e9:.0f} GFLOP/s")
    print(f"load average {load[0][0]:.1f} → {load[1][0]:.1f}")
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
