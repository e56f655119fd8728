"""Documents per second of a ColQwen2-shaped retriever: mlxvlm against transformers.

    python benchmarks/retrieval.py                                  # full 2B shapes
    python benchmarks/retrieval.py --text-layers 4 --vision-layers 4 --output r.json

The checkpoint is ``vidore/colqwen2-v1.0-hf``'s shape with random weights (bfloat16 on
disk): Qwen2-VL-2B's 32-layer 1280-wide ViT and 28-layer 1536-wide text model
(``checkpoints.qwen2vl_2b``'s config, tokenizer and image processor) under
``ColQwen2ForRetrieval``'s 128-wide projection; ``--text-layers`` / ``--vision-layers``
keep fewer layers at the same widths, for hosts where the full model does not fit beside
its float32 copy. It is built once under ``benchmarks/checkpoints/``.

Each engine runs in a fresh process: it loads the checkpoint, embeds one page to warm
up, then embeds ``--pages`` page images (``--page-size`` px squares, as documents are
embedded: the processor's prompt and pixels included) in batches of each
``--batch-sizes``, ``--runs`` times; documents/s is pages over the wall time of one
run. mlxvlm runs torch-free with its defaults (float32 compute on the CPU);
transformers in float32 on PyTorch's CPU kernels. The engines alternate run by run.
mlx-vlm has no ColQwen2 and is not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ENGINES = ("mlxvlm", "transformers")


def checkpoint_dir(text_layers: int, vision_layers: int) -> Path:
    return HERE / "checkpoints" / f"colqwen2-{text_layers}x{vision_layers}-bf16"


def build(target: Path, text_layers: int, vision_layers: int) -> None:
    """ColQwen2 over ``checkpoints.qwen2vl_2b``'s Qwen2-VL-2B shapes, random weights."""
    import torch
    from transformers import ColQwen2Config, ColQwen2ForRetrieval, ColQwen2Processor

    from checkpoints import qwen2vl_2b

    _, vlm, parts, _ = qwen2vl_2b()
    vlm.text_config.num_hidden_layers = text_layers
    vlm.text_config.layer_types = vlm.text_config.layer_types[:text_layers]
    vlm.vision_config.depth = vision_layers
    config = ColQwen2Config(vlm_config=vlm.to_dict(), embedding_dim=128)
    torch.manual_seed(0)
    model = ColQwen2ForRetrieval._from_config(config, dtype=torch.bfloat16).eval()
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    ColQwen2Processor(image_processor=parts.image_processor,
                      tokenizer=parts.tokenizer).save_pretrained(target)
    print(f"wrote {target}", file=sys.stderr)


def pages(count: int, size: int):
    from checkpoints import benchmark_image

    page = benchmark_image(size)
    return [page.rotate(90 * (i % 4)) for i in range(count)]  # same size, distinct pixels


def run_mlxvlm(checkpoint: Path, batch_sizes, count: int, size: int) -> dict:
    import mlxvlm

    model, processor = mlxvlm.load(checkpoint)
    documents = [{"image": p} for p in pages(count, size)]
    mlxvlm.embed(model, processor, documents[:1])  # warm-up
    seconds = {}
    for batch in batch_sizes:
        start = time.perf_counter()
        vectors = mlxvlm.embed(model, processor, documents, batch_size=batch, progress=False)
        seconds[batch] = time.perf_counter() - start
        tokens = vectors[0].shape[0]
    return {"seconds": seconds, "tokens_per_page": tokens}


def run_transformers(checkpoint: Path, batch_sizes, count: int, size: int) -> dict:
    import torch
    from transformers import ColQwen2ForRetrieval, ColQwen2Processor

    model = ColQwen2ForRetrieval.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = ColQwen2Processor.from_pretrained(checkpoint)
    images = pages(count, size)

    def embed(batch_images):
        with torch.no_grad():
            return model(**processor(images=batch_images)).embeddings

    embed(images[:1])  # warm-up
    seconds = {}
    for batch in batch_sizes:
        start = time.perf_counter()
        for first in range(0, count, batch):
            out = embed(images[first:first + batch])
        seconds[batch] = time.perf_counter() - start
    return {"seconds": seconds, "tokens_per_page": int(out.shape[1])}


def worker(args: argparse.Namespace) -> None:
    run = run_mlxvlm if args.worker == "mlxvlm" else run_transformers
    result = run(Path(args.checkpoint), args.batch_sizes, args.pages, args.page_size)
    print(json.dumps(result))


def measure(engine: str, checkpoint: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if engine == "mlxvlm":
        env.pop("MLXVLM_ALLOW_TORCH", None)  # as a user's install runs: without torch
    command = [sys.executable, __file__, "--worker", engine, "--checkpoint", str(checkpoint),
               "--pages", str(args.pages), "--page-size", str(args.page_size),
               "--batch-sizes", *map(str, args.batch_sizes)]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text-layers", type=int, default=28)
    parser.add_argument("--vision-layers", type=int, default=32)
    parser.add_argument("--pages", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=448)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--output", default=None, help="Write the raw runs here (JSON)")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    checkpoint = checkpoint_dir(args.text_layers, args.vision_layers)
    if not (checkpoint / "config.json").exists():
        build(checkpoint, args.text_layers, args.vision_layers)
    runs: dict[str, list[dict]] = {engine: [] for engine in args.engines}
    for run in range(args.runs):
        order = args.engines if run % 2 == 0 else args.engines[::-1]
        for engine in order:
            runs[engine].append(measure(engine, checkpoint, args))
            print(f"run {run + 1} {engine}: {runs[engine][-1]}", file=sys.stderr)
    print(f"| engine | " + " | ".join(f"docs/s, batch {b}" for b in args.batch_sizes) + " |")
    print("| --- |" + " --- |" * len(args.batch_sizes))
    for engine, results in runs.items():
        cells = []
        for batch in args.batch_sizes:
            rates = [args.pages / r["seconds"][str(batch)] for r in results]
            cells.append(f"{statistics.median(rates):.2f} ({min(rates):.2f}–{max(rates):.2f})")
        print(f"| {engine} | " + " | ".join(cells) + " |")
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
