"""Model-switch time of a server of two models with one loaded at a time.

    python benchmarks/model_switch.py                 # smolvlm-256m-bf16 and -4bit
    python benchmarks/model_switch.py --models A B --runs 3 --output switch.json

Starts ``mlxvlm.server``'s app in this process with the two checkpoints and
``--max-loaded-models 1 --min-loaded-seconds 0`` (the first loaded at start, as
``python -m mlxvlm.server`` does), then asks each in turn, ``--runs`` times: a request
to the model not loaded (a switch: the other's engine closed and its memory given back,
this one's weights read and made concrete, then its first token), and the same request
again (loaded: the first token alone). Each request is one greedy token of a text prompt, so the difference is
the switch. Prints median (min-max) of the switch, the load within it, and the request
to a loaded model, with MLX's memory in use after each switch (one model's worth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from server_throughput import serve

HERE = Path(__file__).resolve().parent
DEFAULTS = [HERE / "checkpoints" / "smolvlm-256m-bf16", HERE / "checkpoints" / "smolvlm-256m-4bit"]
PROMPT = "Describe the picture in one word."


def model_memory_mb() -> float:
    """MLX's memory in use: the loaded model's arrays (the process's resident size keeps
    what the allocator holds on to, so it does not show a model given back)."""
    import mlx.core as mx

    return mx.get_active_memory() / 2**20


def ask(base_url: str, model_id: str) -> float:
    body = {"model": model_id, "temperature": 0, "max_tokens": 1,
            "messages": [{"role": "user", "content": PROMPT}]}
    start = time.perf_counter()
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return time.perf_counter() - start


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs=2, type=Path, default=DEFAULTS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    from mlxvlm.server.app import create_registry_app
    from mlxvlm.server.config import ServerConfig
    from mlxvlm.server.models_registry import ModelRegistry, checkpoint_loader

    ids = [path.name for path in args.models]
    # --min-loaded-seconds 0: the switch itself is measured, not the wait for a model's
    # turn to end (which bounds how often a busy server switches).
    config = ServerConfig(model_id=ids[0], model_sources=dict(zip(ids, map(str, args.models))),
                          max_loaded_models=1, prompt_cache_size=0, min_loaded_seconds=0)
    registry = ModelRegistry(config, checkpoint_loader(config))
    registry.preload(ids[0])
    server, thread, base_url = serve(create_registry_app(registry))
    ask(base_url, ids[0])  # the first request of a fresh process warms what is shared
    rows: dict[str, dict[str, list[float]]] = {
        i: {"switch_s": [], "load_s": [], "loaded_s": [], "mlx_memory_mb": []} for i in ids}
    try:
        for _ in range(args.runs):
            for model_id in ids[1], ids[0]:
                row = rows[model_id]
                row["switch_s"].append(ask(base_url, model_id))
                row["load_s"].append(registry._loaded[model_id].load_seconds)
                row["mlx_memory_mb"].append(model_memory_mb())
                row["loaded_s"].append(ask(base_url, model_id))
                assert registry.loaded_ids() == [model_id]
    finally:
        server.should_exit = True
        thread.join(30)
    print("| model switched to | switch: request (s) | of which load (s) | request, loaded (s) "
          "| MLX memory after (MB) |")
    print("| --- | --- | --- | --- | --- |")
    for model_id, row in rows.items():
        print(f"| {model_id} | {summary(row['switch_s'])} | {summary(row['load_s'])} | "
              f"{summary(row['loaded_s'])} | {summary(row['mlx_memory_mb'])} |")
    if args.output:
        args.output.write_text(json.dumps({"models": ids, "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
