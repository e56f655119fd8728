"""One MoE layer's expert banks on MLX's CPU backend: mlx-lm's SwitchGLU on float32 banks
(gather_mm, what mlxvlm ran before) against the same banks kept in bfloat16
(``CPUHalfSwitchLinear``, ``kernels.gathered_half_linear``), for one decoded token and a
prefill chunk; the two alternate run by run. Default shapes: DeepSeek-OCR 2's decoder
(1280 wide, 64 experts of 896, 6 a token).

    python benchmarks/expert_banks.py --tokens 1 1127 --runs 5 --output banks.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlxvlm  # noqa: F401  (the CPU backend's BLAS set-up, before mlx.core)
import mlx.core as mx
from mlx_lm.models.switch_layers import SwitchGLU

from mlxvlm.cpu.half_weights import use_half_weight_layers


def banks(hidden: int, width: int, experts: int):
    import mlx.nn as nn

    mx.random.seed(0)
    half = nn.Module()
    half.switch_mlp = SwitchGLU(hidden, width, experts)
    half.set_dtype(mx.bfloat16)
    full = SwitchGLU(hidden, width, experts)
    full.update(half.switch_mlp.parameters())
    full.set_dtype(mx.float32)
    use_half_weight_layers(half)
    mx.eval(half.parameters(), full.parameters())
    return full, half.switch_mlp


def seconds(layer, x, indices) -> float:
    start = time.perf_counter()
    mx.eval(layer(x, indices))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1280)
    parser.add_argument("--width", type=int, default=896)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--per-token", type=int, default=6)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 1127])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    full, half = banks(args.hidden, args.width, args.experts)
    results = {"shapes": vars(args) | {"output": None}, "load_average": os.getloadavg()[0],
               "bank_bytes": {"float32": sum(full[p].weight.nbytes for p in ("gate_proj", "up_proj", "down_proj")),
                              "bfloat16": sum(half[p].weight.nbytes for p in ("gate_proj", "up_proj", "down_proj"))},
               "seconds": {}}
    for tokens in args.tokens:
        x = mx.random.normal((1, tokens, args.hidden), key=mx.random.key(1))
        scores = mx.random.normal((1, tokens, args.experts), key=mx.random.key(2))
        indices = mx.argpartition(-scores, kth=args.per_token - 1, axis=-1)[..., :args.per_token]
        mx.eval(x, indices)
        diff = mx.abs(full(x, indices) - half(x, indices)).max().item()
        times = {"float32 banks": [], "bf16 banks": []}
        for _ in range(args.runs):
            times["float32 banks"].append(seconds(full, x, indices))
            times["bf16 banks"].append(seconds(half, x, indices))
        results["seconds"][str(tokens)] = times
        medians = {k: statistics.median(v) for k, v in times.items()}
        print(f"{tokens} tokens: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in medians.items())
              + f" (median of {args.runs}; max difference {diff:.2e})")
    print(f"banks: {results['bank_bytes']['float32'] / 1e6:.0f} MB in float32, "
          f"{results['bank_bytes']['bfloat16'] / 1e6:.0f} MB in bf16; load average "
          f"{results['load_average']:.1f}")
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
