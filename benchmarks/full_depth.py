"""A benchmark checkpoint at its model's full depth, grown from one built at reduced depth.

    python benchmarks/checkpoints.py --only glm46v-flash --text-layers 8 --vision-layers 8 --no-quantized
    python benchmarks/full_depth.py glm46v-flash-t8-v8-bf16 --bits 4   # glm46v-flash-4bit

checkpoints.py builds a model in memory, which a host without room for the whole bf16 model
(GLM-4.6V-Flash's 20 GB) cannot do. This writes the full-depth bf16 checkpoint a safetensors
shard at a time: each missing layer is a kept layer of the same kind (self- or
cross-attention) with its rows rolled, so that no two layers are equal and each keeps the
builder's random statistics. Then ``python -m mlxvlm.convert`` quantizes it (lazily, a
shard at a time) and, with ``--bits``, the bf16 copy is removed: a full-depth quantized
checkpoint is made with a few GB of memory and no bf16 model ever in memory.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from checkpoints import BUILDERS, OUT, convert

SHARD_BYTES = 2 << 30
# The decoder's and the vision tower's repeated blocks, as transformers names them
TEXT_LAYER = re.compile(r"^(.*language_model\.layers\.)(\d+)(\..*)$")
VISION_LAYER = re.compile(r"^(.*visual\.blocks\.)(\d+)(\..*)$")


def full_config(name: str) -> dict:
    """The depths the builder gives the whole model: text layers, their cross-attention
    layers (Llama 3.2 Vision), vision layers."""
    _, config, _, _ = BUILDERS[name]()
    vision = config.vision_config
    return {"text_layers": config.text_config.num_hidden_layers,
            "cross": list(getattr(config.text_config, "cross_attention_layers", None) or []),
            "vision_key": "depth" if hasattr(vision, "depth") else "num_hidden_layers",
            "vision_layers": vision.depth if hasattr(vision, "depth") else vision.num_hidden_layers}


def templates(kept: int, full: int, kept_cross: list[int], full_cross: list[int]) -> list[int]:
    """For each of the full model's layers, the kept layer it is made from: itself where
    kept, else a kept layer of the same kind, taken in turn."""
    plain = [index for index in range(kept) if index not in kept_cross]
    if full_cross and not kept_cross:
        raise SystemExit("error: the reduced checkpoint has no cross-attention layer to copy")
    chosen = []
    for index in range(full):
        if index < kept and (index in kept_cross) == (index in full_cross):
            chosen.append(index)
        else:
            pool = kept_cross if index in full_cross else plain
            chosen.append(pool[index % len(pool)])
    return chosen


def grown_names(names: list[str], pattern: re.Pattern, chosen: list[int]) -> dict[str, tuple[str, int]]:
    """New tensor name -> (the kept tensor it copies, how far its rows roll)."""
    by_layer: dict[int, list[tuple[str, str, str]]] = {}
    for name in names:
        match = pattern.match(name)
        if match:
            by_layer.setdefault(int(match[2]), []).append((match[1], match[3], name))
    grown = {}
    for index, template in enumerate(chosen):
        for head, tail, source in by_layer[template]:
            grown[f"{head}{index}{tail}"] = (source, 0 if index == template else index)
    return grown


def grow(source: Path, name: str, target: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    depths = full_config(name)
    config = json.loads((source / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    files = sorted(source.glob("*.safetensors"))
    where = {}
    for path in files:
        with safe_open(path, "pt") as handle:
            where.update(dict.fromkeys(handle.keys(), path))
    names = list(where)
    plan = {n: (n, 0) for n in names if not TEXT_LAYER.match(n) and not VISION_LAYER.match(n)}
    plan.update(grown_names(names, TEXT_LAYER, templates(
        text["num_hidden_layers"], depths["text_layers"],
        text.get("cross_attention_layers") or [], depths["cross"])))
    kept_vision = vision[depths["vision_key"]]
    if kept_vision != depths["vision_layers"] and not any(VISION_LAYER.match(n) for n in names):
        raise SystemExit(f"error: no vision blocks named like {VISION_LAYER.pattern} to grow")
    plan.update(grown_names(names, VISION_LAYER, templates(
        kept_vision, depths["vision_layers"], [], [])))

    target.mkdir(parents=True, exist_ok=True)
    handles = {path: safe_open(path, "pt") for path in files}
    shards: list[dict] = [{}]
    size = 0
    written: list[tuple[str, list[str]]] = []

    def flush(last: bool) -> None:
        shard = shards.pop()
        if shard:
            file = f"model-{len(written) + 1:05d}.safetensors"
            save_file(shard, str(target / file), metadata={"format": "pt"})
            written.append((file, list(shard)))
        if not last:
            shards.append({})

    for new_name, (old_name, roll) in plan.items():
        tensor = handles[where[old_name]].get_tensor(old_name)
        shards[-1][new_name] = torch.roll(tensor, roll, 0).contiguous() if roll else tensor
        size += tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            flush(last=False)
            size = 0
    flush(last=True)
    # The index names each shard "of N", as transformers writes them
    total = len(written)
    weight_map = {}
    for number, (file, tensors) in enumerate(written, start=1):
        final = f"model-{number:05d}-of-{total:05d}.safetensors"
        (target / file).rename(target / final)
        weight_map.update(dict.fromkeys(tensors, final))
    (target / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}, indent=2))

    text["num_hidden_layers"] = depths["text_layers"]
    if depths["cross"]:
        text["cross_attention_layers"] = depths["cross"]
    vision[depths["vision_key"]] = depths["vision_layers"]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for path in source.iterdir():  # tokenizer, processor, template, image, prompt
        if path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, target / path.name)
    print(f"wrote {target} ({len(plan)} tensors, {total} shards)", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", help="A reduced-depth bf16 checkpoint under benchmarks/checkpoints/")
    parser.add_argument("--bits", type=int, choices=[4, 8], default=None,
                        help="Quantize the full-depth checkpoint, then remove its bf16 copy")
    args = parser.parse_args()
    source = Path(args.source) if Path(args.source).is_dir() else OUT / args.source
    name = next((n for n in sorted(BUILDERS, key=len, reverse=True)
                 if source.name.startswith(n + "-")), None)
    if name is None:
        raise SystemExit(f"error: {source.name} is not named after a builder in checkpoints.py")
    target = OUT / f"{name}-bf16"
    grow(source, name, target)
    if args.bits:
        convert(target, args.bits)
        shutil.rmtree(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
