"""Peak RSS and decode speed with Gemma's per-layer embedding table in memory (before)
and gathered from the checkpoint's file (after, mlxvlm/checkpoint/disk_tables.py).

    python benchmarks/per_layer_table.py [--layers 5] [--runs 3] [--max-tokens 24] [--bits 4]

Builds (once) ``benchmarks/checkpoints/gemma4-e2b-text{L}-bf16``: google/gemma-4-E2B-it's
shapes from ``checkpoints.py`` (1536-wide, 256-wide per-layer inputs over the 262,144-word
vocabulary, 8 heads of 256, global layers of 512, double-wide MLPs in the KV-sharing
layers, the tokenizer, processor and chat template) at ``L`` text layers instead of 35
(sliding, sliding, global, then KV-sharing sliding and global layers: ``L - 2`` of their
own, the last 2 sharing), and one-layer towers; random bfloat16 weights written straight
from MLX in MLX's layout (the per-layer table alone in the second of three files). The
per-layer table keeps its real row width per layer: ``L`` x 256 x 262,144. ``--bits``
measures its 4- or 8-bit conversion (``python -m mlxvlm.convert -q``: the table quantized
too) instead.

Each run is a fresh process (``--measure``): ``mlxvlm.load``, then a greedy answer to the
80-word benchmark prompt with ``--max-tokens`` tokens; it reports the process's peak RSS,
MLX's peak allocation and ``generate``'s decode tokens/s. The two settings alternate run
by run, their order reversed every other run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def layer_types(layers: int) -> list[str]:
    own = ["sliding_attention", "sliding_attention", "full_attention"]
    own += ["sliding_attention"] * (layers - 2 - len(own))
    return own + ["sliding_attention", "full_attention"]


def build(target: Path, layers: int) -> None:
    import mlx.core as mx

    import checkpoints  # benchmarks/checkpoints.py
    from mlxvlm.checkpoint.loading import CONVERTED_MARKER
    from mlxvlm.models import gemma4

    _, config, parts, eos_ids = checkpoints.gemma4_e2b()
    text = config.text_config
    text.num_hidden_layers, text.layer_types = layers, layer_types(layers)
    text.num_kv_shared_layers = 2
    config.vision_config.num_hidden_layers = 1
    config.audio_config.num_hidden_layers = 1
    config_dict = config.to_dict()
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({**config_dict, CONVERTED_MARKER: True}))
    parts.save(target)  # tokenizer, processor, template; config.json in the Hub's layout

    from mlx.utils import tree_flatten

    model = gemma4.Model.from_config(json.loads((target / "config.json").read_text()))
    shapes = {name: value.shape for name, value in tree_flatten(model.parameters())}
    del model
    table = "language_model.model.embed_tokens_per_layer.weight"
    groups = [[n for n in shapes if n not in (table,) and "embed_tokens" not in n],
              [table], [n for n in shapes if n != table and "embed_tokens" in n]]
    mx.random.seed(0)
    weight_map = {}
    for index, names in enumerate(groups, start=1):
        # Drawn in bfloat16, one file at a time: the builder holds one file's tensors.
        tensors = {n: (mx.random.normal(shapes[n], dtype=mx.bfloat16) * 0.02
                       if len(shapes[n]) > 1 else mx.ones(shapes[n], dtype=mx.bfloat16))
                   for n in names}
        embed = "language_model.model.embed_tokens.weight"
        if embed in tensors:  # the tied head never picks end-of-sequence: fixed lengths
            tensors[embed][mx.array(eos_ids)] = 0
        name = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        mx.save_safetensors(str(target / name), tensors, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(names, name))
        del tensors
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    (target / "benchmark.json").write_text(json.dumps({"prompt": checkpoints.PROMPT}))
    print(f"wrote {target}", file=sys.stderr)


def measure(path: Path, whole: bool, max_tokens: int) -> dict:
    """One run in this process (``--measure``)."""
    import resource
    import time

    import mlx.core as mx

    import mlxvlm

    start = time.perf_counter()
    model, processor = mlxvlm.load(str(path), tables_on_disk=not whole)
    load_s = time.perf_counter() - start
    prompt = json.loads((path / "benchmark.json").read_text())["prompt"]
    out = mlxvlm.generate(model, processor, prompt, max_tokens=max_tokens, temperature=0.0)
    return {
        "setting": "whole" if whole else "gathered",
        "load_s": load_s,
        "decode_tps": out.generation_tps,
        "prompt_tps": out.prompt_tps,
        "tokens": out.generation_tokens,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "mlx_peak_gb": mx.get_peak_memory() / 1e9,
        "table_on_disk": sorted(model.tables_on_disk),
        "table_gb": sum(dict(model.named_modules())[p].stored_bytes
                        for p in model.tables_on_disk) / 1e9,
    }


def one_run(path: Path, whole: bool, max_tokens: int) -> dict:
    command = [sys.executable, __file__, "--measure", str(path), "--max-tokens", str(max_tokens)]
    result = subprocess.run(command + (["--whole"] if whole else []), check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=5, help="text layers (E2B: 35)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--bits", type=int, choices=(4, 8),
                        help="measure a quantized conversion (made with mlxvlm.convert)")
    parser.add_argument("--output", type=Path, help="also write every run's figures (JSON)")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.whole, args.max_tokens)))
        return 0
    path = HERE / "checkpoints" / f"gemma4-e2b-text{args.layers}-bf16"
    if not (path / "model.safetensors.index.json").exists():
        build(path, args.layers)
    if args.bits is not None:
        quantized = path.with_name(path.name.replace("-bf16", f"-{args.bits}bit"))
        if not (quantized / "benchmark.json").exists():
            subprocess.run([sys.executable, "-m", "mlxvlm.convert", "--hf-path", str(path),
                            "--mlx-path", str(quantized), "-q", "--q-bits", str(args.bits),
                            "--force"], check=True)
            (quantized / "benchmark.json").write_bytes((path / "benchmark.json").read_bytes())
        path = quantized
    runs = []
    for i in range(args.runs):
        for whole in ((True, False) if i % 2 == 0 else (False, True)):
            runs.append(one_run(path, whole, args.max_tokens))
            print(json.dumps(runs[-1]), file=sys.stderr)
    if args.output is not None:
        args.output.write_text(json.dumps(runs, indent=2))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
    table = runs[0]["table_gb"] if runs[0]["setting"] == "gathered" else runs[1]["table_gb"]
    print(f"checkpoint {path.name}: {size:.2f} GB, the per-layer table {table:.2f} GB; "
          f"{args.runs} runs each, {args.max_tokens} tokens; median (min-max)")
    print("| setting | peak RSS (GB) | MLX peak (GB) | decode tokens/s | load (s) |")
    print("| --- | --- | --- | --- | --- |")
    for setting in ("whole", "gathered"):
        rows = [r for r in runs if r["setting"] == setting]
        print(f"| {setting} | {summary([r['peak_rss_gb'] for r in rows])} | "
              f"{summary([r['mlx_peak_gb'] for r in rows])} | "
              f"{summary([r['decode_tps'] for r in rows])} | {summary([r['load_s'] for r in rows])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
