"""DeepSeek-OCR 2's vision path, one view at a time, with a timer per stage: SAM's patch
embedding and position table, each of its blocks (windowed or global), its neck and
convolutions, the Qwen2 query encoder and the projector; MLX's peak memory per view.

    python benchmarks/deepseek_ocr2_vision.py benchmarks/checkpoints/deepseek-ocr2-bf16 --views 768 1024

Random pixels: the cost depends on the view's size only. Prints one JSON line per view."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

sys.modules["torch"] = None  # as a user's install: transformers without torch

from mlxvlm import load  # noqa: E402  (first: it sets up the CPU backend before MLX loads)

import mlx.core as mx  # noqa: E402


def timed(timings: dict, name: str, fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    mx.eval(out)
    timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - start, 3)
    return out


def profile_view(model, size: int) -> dict:
    sam, encoder = model.sam_model, model.vision_model.qwen2_encoder
    dtype = encoder.norm.weight.dtype
    pixels = mx.random.normal((1, size, size, 3)).astype(dtype)
    mx.eval(pixels)
    mx.reset_peak_memory()
    timings: dict[str, float] = {}
    start = time.perf_counter()
    h = timed(timings, "patch_embed", sam.patch_embed, pixels)
    positions = timed(timings, "positions", sam.positions, h.shape[1], h.shape[2])
    h = h + positions.astype(h.dtype)
    for index, block in enumerate(sam.blocks):
        kind = "window" if block.window_size else "global"
        h = timed(timings, f"block{index:02d}_{kind}", block, h)
    def neck(h):
        for layer in sam.neck:
            h = layer(h)
        h = sam.net_3(sam.net_2(h))
        return h.reshape(h.shape[0], -1, h.shape[-1])
    patches = timed(timings, "neck_and_convolutions", neck, h)
    queries = timed(timings, "query_encoder", encoder, patches)
    timed(timings, "projector", model.projector, queries)
    total = time.perf_counter() - start
    return {"view": size, "dtype": str(dtype), "seconds": round(total, 3),
            "sam_global_blocks_s": round(sum(v for k, v in timings.items() if k.endswith("global")), 3),
            "sam_window_blocks_s": round(sum(v for k, v in timings.items() if k.endswith("window")), 3),
            "mlx_peak_gb": round(mx.get_peak_memory() / 1e9, 3), "stages_s": timings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--views", type=int, nargs="+", default=[768, 1024])
    args = parser.parse_args()
    start = time.perf_counter()
    model, _ = load(args.checkpoint)
    print(json.dumps({"load_s": round(time.perf_counter() - start, 1)}), flush=True)
    for size in args.views:
        result = profile_view(model, size)
        result["max_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
