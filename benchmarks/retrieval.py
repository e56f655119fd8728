"""Documents per second of retrievers: mlxvlm against transformers.

    python benchmarks/retrieval.py                                  # full 2B shapes
    python benchmarks/retrieval.py --model qwen3vl-embedding-2b --text-layers 2 \
        --vision-layers 2 --output r.json

The checkpoints have real shapes and random weights (bfloat16 on disk):

- ``colqwen2`` (default): ``vidore/colqwen2-v1.0-hf``'s shape, Qwen2-VL-2B's 32-layer
  1280-wide ViT and 28-layer 1536-wide text model (``checkpoints.qwen2vl_2b``'s config,
  tokenizer and image processor) under ``ColQwen2ForRetrieval``'s 128-wide projection;
  its documents are page images;
- ``qwen3vl-embedding-2b``: ``Qwen/Qwen3-VL-Embedding-2B``'s shape
  (``checkpoints.qwen3vl_embedding_2b``: a 24-layer 1024-wide ViT with DeepStack taps, a
  28-layer 2048-wide Qwen3 decoder, the sentence-transformers files); its documents are
  texts of ``--text-words`` tokens and page images. transformers runs the model card's
  recipe (the official script's): the chat with the default instruction as system turn,
  a right-padded batch through ``Qwen3VLModel``, the last attended token's hidden state,
  L2-normalized. Pages are multiples of 32 px, which the script's image sizing keeps.

``--text-layers`` / ``--vision-layers`` keep fewer layers at the same widths, for hosts
where the full model does not fit beside its float32 copy (fewer ViT layers keep that
many DeepStack taps, spread over them). Each is built once under
``benchmarks/checkpoints/``.

Each engine runs in a fresh process: it loads the checkpoint, embeds one document of
each kind to warm up, then embeds ``--pages`` documents of each kind (as documents are
embedded: the processor's prompt and pixels included) in batches of each
``--batch-sizes``, ``--runs`` times; documents/s is documents over the wall time of one
run. The first document's vector from each engine is compared (``max |diff|`` in the
log and the JSON). mlxvlm runs torch-free with its defaults (float32 compute on the
CPU); transformers in float32 on PyTorch's CPU kernels. The engines alternate run by
run. mlx-vlm is not installed here and is not measured.
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


MODELS = ("colqwen2", "qwen3vl-embedding-2b")
# The kinds of documents each model embeds here.
DOCUMENT_KINDS = {"colqwen2": ("page",), "qwen3vl-embedding-2b": ("text", "page")}


def checkpoint_dir(model: str, text_layers: int, vision_layers: int) -> Path:
    return HERE / "checkpoints" / f"{model}-{text_layers}x{vision_layers}-bf16"


def build_colqwen2(target: Path, text_layers: int, vision_layers: int) -> None:
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


def build_qwen3vl_embedding(target: Path, text_layers: int, vision_layers: int) -> None:
    """``checkpoints.qwen3vl_embedding_2b``'s shapes at the given depths, random weights."""
    import torch

    from checkpoints import qwen3vl_embedding_2b

    model_class, config, parts, _ = qwen3vl_embedding_2b()
    text = config.text_config
    text.num_hidden_layers = text_layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:text_layers]
    vision = config.vision_config
    taps = len(vision.deepstack_visual_indexes)
    if vision_layers < vision.depth:
        vision.deepstack_visual_indexes = sorted(
            {round(i * (vision_layers - 1) / max(taps - 1, 1)) for i in range(taps)})
    vision.depth = vision_layers
    torch.manual_seed(0)
    model = model_class._from_config(config, dtype=torch.bfloat16).eval()
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    parts.save(target)


def build(model: str, target: Path, text_layers: int, vision_layers: int) -> None:
    builder = build_colqwen2 if model == "colqwen2" else build_qwen3vl_embedding
    builder(target, text_layers, vision_layers)
    print(f"wrote {target}", file=sys.stderr)


def pages(count: int, size: int):
    from checkpoints import benchmark_image

    page = benchmark_image(size)
    return [page.rotate(90 * (i % 4)) for i in range(count)]  # same size, distinct pixels


def texts(count: int, words: int) -> list[str]:
    """Distinct texts of ``words`` one-token words (the word-level tokenizer's)."""
    return [" ".join(f"w{(i * 97 + j) % 50000}" for j in range(words)) for i in range(count)]


def documents(kind: str, args: argparse.Namespace) -> list:
    if kind == "text":
        return texts(args.pages, args.text_words)
    return pages(args.pages, args.page_size)


def timed(embed, items: list, batch_sizes) -> tuple[dict, object]:
    """Seconds per batch size for ``embed`` over ``items`` cut into batches, and the
    first item's vectors."""
    embed(items[:1])  # warm-up
    seconds, first = {}, None
    for batch in batch_sizes:
        start = time.perf_counter()
        for offset in range(0, len(items), batch):
            out = embed(items[offset:offset + batch])
            if offset == 0:
                first = out[0]
        seconds[batch] = time.perf_counter() - start
    return seconds, first


def run_mlxvlm(args: argparse.Namespace) -> dict:
    import mlxvlm

    model, processor = mlxvlm.load(args.checkpoint)
    result = {}
    for kind in DOCUMENT_KINDS[args.model]:
        items = [{kind if kind == "text" else "image": d} for d in documents(kind, args)]

        def embed(batch):
            return mlxvlm.embed(model, processor, batch, batch_size=len(batch), progress=False)

        seconds, first = timed(embed, items, args.batch_sizes)
        result[kind] = {"seconds": seconds, "first": first}
    return result


def colqwen2_embedder(checkpoint: str):
    import torch
    from transformers import ColQwen2ForRetrieval, ColQwen2Processor

    model = ColQwen2ForRetrieval.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = ColQwen2Processor.from_pretrained(checkpoint)

    def embed(images):
        with torch.no_grad():
            return model(**processor(images=images)).embeddings.numpy()

    return embed


def qwen3vl_embedding_embedder(checkpoint: str):
    """The official script's embedding (see the module's docstring)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(checkpoint)
    processor.tokenizer.padding_side = "right"

    def embed(items):
        conversations = [[
            {"role": "system", "content": [{"type": "text", "text": "Represent the user's input."}]},
            {"role": "user", "content": [{"type": "image"}] if not isinstance(item, str)
             else [{"type": "text", "text": item}]},
        ] for item in items]
        prompts = [processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                   for c in conversations]
        images = [item for item in items if not isinstance(item, str)]
        inputs = processor(text=prompts, images=images or None, padding=True, do_resize=False,
                           return_tensors="pt")
        with torch.no_grad():
            hidden = model.model(**inputs).last_hidden_state
        mask = inputs["attention_mask"]
        last = mask.shape[1] - 1 - mask.flip(dims=[1]).argmax(dim=1)
        return F.normalize(hidden[torch.arange(len(items)), last], dim=-1).numpy()

    return embed


def run_transformers(args: argparse.Namespace) -> dict:
    if args.model == "colqwen2":
        embed = colqwen2_embedder(args.checkpoint)
    else:
        assert args.page_size % 32 == 0, "pages the official script would resize"
        embed = qwen3vl_embedding_embedder(args.checkpoint)
    result = {}
    for kind in DOCUMENT_KINDS[args.model]:
        seconds, first = timed(embed, documents(kind, args), args.batch_sizes)
        result[kind] = {"seconds": seconds, "first": first}
    return result


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    run = run_mlxvlm if args.worker == "mlxvlm" else run_transformers
    result = run(args)
    for kind, measured in result.items():
        first = np.asarray(measured.pop("first"), dtype=np.float32)
        np.save(Path(args.vectors) / f"{args.worker}-{kind}.npy", first)
        measured["tokens" if first.ndim == 2 else "dim"] = int(first.shape[0])
    print(json.dumps(result))


def measure(engine: str, checkpoint: Path, args: argparse.Namespace, vectors: Path) -> dict:
    env = dict(os.environ)
    if engine == "mlxvlm":
        env.pop("MLXVLM_ALLOW_TORCH", None)  # as a user's install runs: without torch
    command = [sys.executable, __file__, "--worker", engine, "--checkpoint", str(checkpoint),
               "--model", args.model, "--pages", str(args.pages),
               "--page-size", str(args.page_size), "--text-words", str(args.text_words),
               "--vectors", str(vectors), "--batch-sizes", *map(str, args.batch_sizes)]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def differences(vectors: Path, kinds) -> dict:
    """max |mlxvlm - transformers| of the first document's vectors, per kind."""
    import numpy as np

    return {kind: float(np.abs(np.load(vectors / f"mlxvlm-{kind}.npy")
                               - np.load(vectors / f"transformers-{kind}.npy")).max())
            for kind in kinds}


def main() -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default="colqwen2")
    parser.add_argument("--text-layers", type=int, default=28)
    parser.add_argument("--vision-layers", type=int, default=None,
                        help="default: the model's (32 for colqwen2, 24 for qwen3vl-embedding-2b)")
    parser.add_argument("--pages", type=int, default=8, help="documents of each kind")
    parser.add_argument("--page-size", type=int, default=448)
    parser.add_argument("--text-words", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--output", default=None, help="Write the raw runs here (JSON)")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--vectors", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.vision_layers is None:
        args.vision_layers = 32 if args.model == "colqwen2" else 24
    checkpoint = checkpoint_dir(args.model, args.text_layers, args.vision_layers)
    if not (checkpoint / "config.json").exists():
        build(args.model, checkpoint, args.text_layers, args.vision_layers)
    kinds = DOCUMENT_KINDS[args.model]
    runs: dict[str, list[dict]] = {engine: [] for engine in args.engines}
    with tempfile.TemporaryDirectory() as scratch:
        vectors = Path(scratch)
        for run in range(args.runs):
            order = args.engines if run % 2 == 0 else args.engines[::-1]
            for engine in order:
                runs[engine].append(measure(engine, checkpoint, args, vectors))
                print(f"run {run + 1} {engine}: {runs[engine][-1]}", file=sys.stderr)
        diff = differences(vectors, kinds) if len(args.engines) == 2 else {}
    print(f"max |mlxvlm - transformers| of the first document's vectors: {diff}", file=sys.stderr)
    print("| engine | documents | " + " | ".join(f"docs/s, batch {b}" for b in args.batch_sizes)
          + " |")
    print("| --- | --- |" + " --- |" * len(args.batch_sizes))
    for engine, results in runs.items():
        for kind in kinds:
            cells = []
            for batch in args.batch_sizes:
                rates = [args.pages / r[kind]["seconds"][str(batch)] for r in results]
                cells.append(f"{statistics.median(rates):.2f}" if len(rates) == 1 else
                             f"{statistics.median(rates):.2f} ({min(rates):.2f}–{max(rates):.2f})")
            print(f"| {engine} | {kind} | " + " | ".join(cells) + " |")
    if args.output:
        Path(args.output).write_text(json.dumps(
            {"args": vars(args), "max_abs_difference": diff, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
