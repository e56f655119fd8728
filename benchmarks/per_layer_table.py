"""Peak RSS and decode speed with Gemma's per-layer embedding table in memory (before)
and gathered from the checkpoint's file (after, mlxvlm/checkpoint/disk_tables.py).

    python benchmarks/per_layer_table.py [--family gemma4|gemma3n] [--layers 5] [--runs 3]
        [--max-tokens 24] [--bits 4]

Builds (once) ``benchmarks/checkpoints/{family}-e2b-text{L}-bf16``, an E2B model's text
shapes at ``L`` text layers instead of 35 (Gemma 4) or 30 (Gemma 3n): sliding, sliding,
global (4 layers: sliding, global), more sliding ones, then a KV-sharing sliding and
global layer. ``--family gemma4 --layers 35`` keeps the real model's pattern (a global
layer every fifth, the last 20 sharing KV): the full-depth E2B, written a slab at a time
like the others, so no 10 GB model is ever in memory. ``gemma4``:
google/gemma-4-E2B-it's (``checkpoints.py``'s config, tokenizer, processor and chat
template: 1536-wide, 8 heads of 256, global layers of 512, double-wide MLPs in the
KV-sharing layers) with one-layer towers; ``gemma3n``: google/gemma-3n-E2B-it's (2048-wide,
8192-wide MLPs, AltUp, Laurel, the 262,400-word vocabulary and its special ids) with a
small vision tower and a one-layer audio conformer. Random bfloat16 weights are written
a slab at a time in MLX's layout (the per-layer table alone in the second of three
files; the builder holds no whole tensor). The per-layer table keeps its real row width per layer: ``L`` x 256 x 262,144.
``--bits`` measures its 4- or 8-bit conversion (``python -m mlxvlm.convert -q``: the table
quantized too) instead.

Each run is a fresh process (``--measure``): ``mlxvlm.load``, then a greedy answer to the
80-word benchmark prompt with ``--max-tokens`` tokens; it reports the process's peak RSS,
MLX's peak allocation and ``generate``'s decode tokens/s. The two settings alternate run
by run, their order reversed every other run. ``--step-rounds N`` times decode steps
instead, both settings in one process (less of a shared host's drift between them).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def layer_types(layers: int) -> list[str]:
    """``layers`` (at least 4) layer types; the last two share the KV of the last layers
    of their type before them, so each type comes before them too."""
    own = ["sliding_attention", "sliding_attention", "full_attention"][-(layers - 2):]
    own += ["sliding_attention"] * (layers - 2 - len(own))
    return own + ["sliding_attention", "full_attention"]


def gemma4_e2b(target: Path, layers: int) -> list[int]:
    """google/gemma-4-E2B-it's config and processor files (``checkpoints.py``'s) at
    ``layers`` text layers, one-layer towers; returns the end-of-sequence ids."""
    import checkpoints  # benchmarks/checkpoints.py
    from mlxvlm.checkpoint.loading import CONVERTED_MARKER

    _, config, parts, eos_ids = checkpoints.gemma4_e2b()
    text = config.text_config
    if layers != text.num_hidden_layers:  # at full depth the real pattern and KV sharing
        text.num_hidden_layers, text.layer_types = layers, layer_types(layers)
        text.num_kv_shared_layers = 2
    config.vision_config.num_hidden_layers = 1
    config.audio_config.num_hidden_layers = 1
    (target / "config.json").write_text(json.dumps({**config.to_dict(), CONVERTED_MARKER: True}))
    parts.save(target)  # tokenizer, processor, template; config.json in the Hub's layout
    return eos_ids


# A small MobileNetV5 (timm's block strings) in place of Gemma 3n's 300M-parameter tower,
# which a text prompt never runs: 4 x 4 soft tokens from a 128-pixel image.
GEMMA3N_TOWER = [["er_r1_k3_s2_e4_c16"],
                 ["uir_r1_a3_k5_s2_e4_c24", "uir_r1_a3_k0_s1_e2_c24"],
                 ["uir_r1_a5_k5_s2_e4_c32", "mqa_r1_k3_h2_v2_s1_d8_c32", "uir_r1_a0_k0_s1_e2_c32"],
                 ["uir_r1_a5_k5_s2_e4_c40", "mqa_r1_k3_h2_s1_d8_c40", "uir_r1_a0_k0_s1_e2_c40"]]
GEMMA3N_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'audio' %}<audio_soft_token>"
    "{% elif item['type'] == 'image' %}<image_soft_token>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma3n_e2b(target: Path, layers: int) -> list[int]:
    """google/gemma-3n-E2B-it's text shapes (2048 wide, 8192-wide MLPs, 8 heads of 256
    over 2 KV heads, 256-wide per-layer inputs, AltUp, Laurel, activation sparsity on the
    first third of the layers, the 262,400-word vocabulary and its ids) at ``layers``
    layers, a small vision tower and a one-layer audio conformer; returns the
    end-of-sequence ids."""
    from timm.models._efficientnet_builder import decode_arch_def
    from transformers import (Gemma3nAudioFeatureExtractor, Gemma3nConfig, Gemma3nProcessor,
                              SiglipImageProcessorPil)

    import checkpoints  # benchmarks/checkpoints.py
    from mlxvlm.checkpoint.loading import CONVERTED_MARKER

    special = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 105,
               "<end_of_turn>": 106, "<start_of_image>": 255999, "<start_of_audio>": 256000,
               "<end_of_image>": 262144, "<image_soft_token>": 262145,
               "<end_of_audio>": 262272, "<audio_soft_token>": 262273}
    tokenizer = checkpoints.word_level_tokenizer(
        262400, special, eos="<eos>", pad="<pad>", bos="<bos>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>",
                              "boa_token": "<start_of_audio>", "eoa_token": "<end_of_audio>",
                              "audio_token": "<audio_soft_token>"})
    tokenizer.chat_template = GEMMA3N_TEMPLATE
    sparse = -(-layers // 3)
    config = Gemma3nConfig(
        text_config=dict(hidden_size=2048, num_hidden_layers=layers,
                         intermediate_size=[8192] * layers, layer_types=layer_types(layers),
                         num_kv_shared_layers=2,
                         activation_sparsity_pattern=[0.95] * sparse + [0.0] * (layers - sparse)),
        vision_config=dict(architecture="mobilenetv5_300m_enc", hidden_size=2048,
                           model_args={"block_args": decode_arch_def(GEMMA3N_TOWER),
                                       "stem_size": 16, "msfa_output_resolution": 4}),
        audio_config=dict(conf_num_hidden_layers=1),
        vision_soft_tokens_per_image=16, eos_token_id=[1, 106],
    )
    (target / "config.json").write_text(json.dumps({**config.to_dict(), CONVERTED_MARKER: True}))
    Gemma3nProcessor(
        feature_extractor=Gemma3nAudioFeatureExtractor(),
        image_processor=SiglipImageProcessorPil(size={"height": 128, "width": 128},
                                                image_mean=[0.5] * 3, image_std=[0.5] * 3),
        tokenizer=tokenizer, chat_template=GEMMA3N_TEMPLATE, image_seq_length=16,
    ).save_pretrained(target)
    return [1, 106]


FAMILIES = {"gemma4": gemma4_e2b, "gemma3n": gemma3n_e2b}


def write_random_bf16(file: Path, shapes: dict[str, tuple[int, ...]], zero_rows: dict,
                      rng) -> None:
    """A safetensors file of random bfloat16 tensors (``shapes``), written a slab of rows
    at a time so that the builder never holds a whole tensor: matrices drawn from
    N(0, 0.02), vectors ones; ``zero_rows``: name -> rows left zero."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "mlx"}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in shapes.items():
            if len(shape) < 2:
                out.write(np.full(shape, 0x3F80, dtype=np.uint16).tobytes())  # 1.0
                continue
            row = math.prod(shape[1:])
            step = max(1, (1 << 24) // row)
            for start in range(0, shape[0], step):
                rows = min(step, shape[0] - start)
                values = (rng.standard_normal((rows, row), dtype=np.float32) * 0.02)
                for r in zero_rows.get(name, ()):
                    if start <= r < start + rows:
                        values[r - start] = 0
                out.write((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())


def build(target: Path, family: str, layers: int) -> None:
    """The checkpoint: ``family``'s config and processor files, random bfloat16 weights
    in three files (the per-layer table alone in the second)."""
    from mlx.utils import tree_flatten

    import checkpoints  # benchmarks/checkpoints.py
    from mlxvlm.models import get_family

    target.mkdir(parents=True, exist_ok=True)
    eos_ids = FAMILIES[family](target, layers)
    config = json.loads((target / "config.json").read_text())
    model = get_family(config["model_type"]).Model.from_config(config)
    shapes = {name: tuple(value.shape) for name, value in tree_flatten(model.parameters())}
    del model
    table = "language_model.model.embed_tokens_per_layer.weight"
    embed = "language_model.model.embed_tokens.weight"
    groups = [[n for n in shapes if n not in (table, embed)], [table], [embed]]
    rng = np.random.default_rng(0)
    weight_map = {}
    for index, names in enumerate(groups, start=1):
        name = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        # the tied head never picks end-of-sequence: every answer has --max-tokens tokens
        write_random_bf16(target / name, {n: shapes[n] for n in names}, {embed: eos_ids}, rng)
        weight_map.update(dict.fromkeys(names, name))
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


def decode_steps(path: Path, rounds: int, steps: int = 14) -> None:
    """Decode steps timed in this one process, the two settings alternating (their order
    reversed every other round): a 64-token prompt, then ``steps`` greedy steps, the
    first two left out of the median."""
    import gc
    import time

    import mlx.core as mx

    import mlxvlm

    for i in range(rounds):
        for whole in ((True, False) if i % 2 == 0 else (False, True)):
            model, _ = mlxvlm.load(str(path), tables_on_disk=not whole)
            cache = model.make_cache()
            mx.eval(model(mx.array([list(range(3, 67))]), cache, last_only=True))
            token, times = mx.array([[5]]), []
            for _ in range(steps):
                start = time.perf_counter()
                token = mx.argmax(model(token, cache, last_only=True)[:, -1], axis=-1,
                                  keepdims=True)
                mx.eval(token)
                times.append(time.perf_counter() - start)
            kept = times[2:]
            print(f"round {i + 1} {'whole' if whole else 'gathered'}: median step "
                  f"{1000 * statistics.median(kept):.1f} ms, fastest {1000 * min(kept):.1f} ms",
                  flush=True)
            del model, cache
            gc.collect()


def one_run(path: Path, whole: bool, max_tokens: int) -> dict:
    command = [sys.executable, __file__, "--measure", str(path), "--max-tokens", str(max_tokens)]
    result = subprocess.run(command + (["--whole"] if whole else []), check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gemma4")
    parser.add_argument("--layers", type=int, default=5,
                        help="text layers (E2B: Gemma 4 35, Gemma 3n 30)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--bits", type=int, choices=(4, 8),
                        help="measure a quantized conversion (made with mlxvlm.convert)")
    parser.add_argument("--step-rounds", type=int, default=0,
                        help="instead: time decode steps in one process, this many rounds")
    parser.add_argument("--output", type=Path, help="also write every run's figures (JSON)")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.whole, args.max_tokens)))
        return 0
    path = HERE / "checkpoints" / f"{args.family}-e2b-text{args.layers}-bf16"
    if not (path / "model.safetensors.index.json").exists():
        build(path, args.family, args.layers)
    if args.bits is not None:
        quantized = path.with_name(path.name.replace("-bf16", f"-{args.bits}bit"))
        if not (quantized / "benchmark.json").exists():
            subprocess.run([sys.executable, "-m", "mlxvlm.convert", "--hf-path", str(path),
                            "--mlx-path", str(quantized), "-q", "--q-bits", str(args.bits),
                            "--force"], check=True)
            (quantized / "benchmark.json").write_bytes((path / "benchmark.json").read_bytes())
        path = quantized
    if args.step_rounds:
        decode_steps(path, args.step_rounds)
        return 0
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
