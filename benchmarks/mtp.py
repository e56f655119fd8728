"""Decode speed with and without MTP drafting (``--mtp``) on a Qwen3.5-shaped model with
random weights, in one process: no download, no tokenizer.

    python benchmarks/mtp.py --runs 3 --max-tokens 64 --output mtp.json

The model is ``qwen3_5.Model`` built from a config here (``--hidden``, ``--layers``: three
Gated DeltaNet layers to one full-attention layer, as released; a tied 32k vocabulary)
with MLX's random initialization and mlxvlm's CPU fast paths, fed a random prompt.

Random weights make a head that agrees with the model by chance only, so the ``mtp`` rows
measure the cost side: every pass drafts, nearly every draft is rejected, and Qwen3.5's
recurrent layers, which cannot be trimmed, feed the kept token again in the next pass.
The ``mtp oracle`` rows are the self-consistent check: the same head steps run for their
cost, but the drafts proposed are the tokens the plain run chose (known beforehand), so
every draft is accepted -- what a head that always agrees would give. A trained head
lands in between, by its acceptance rate.

Runs alternate configuration by configuration, so that a slow stretch of a shared host
falls on all of them. Greedy runs are checked against the plain run's tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def model_config(hidden: int, layers: int, vocab: int) -> dict:
    heads = max(hidden // 128, 2)
    return {
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "image_token_id": vocab - 3, "video_token_id": vocab - 2,
        "text_config": {
            "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 3 * hidden, "num_attention_heads": heads,
            "num_key_value_heads": max(heads // 4, 1), "head_dim": 128,
            "vocab_size": vocab, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "full_attention_interval": 4, "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                "mrope_section": [6, 5, 5], "mrope_interleaved": True,
                                "partial_rotary_factor": 0.25},
            "linear_num_key_heads": heads, "linear_num_value_heads": 2 * heads,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
        },
        "vision_config": {"depth": 1, "hidden_size": 64, "intermediate_size": 128,
                          "out_hidden_size": hidden, "num_heads": 2, "patch_size": 16,
                          "num_position_embeddings": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "in_channels": 3},
    }


def build_model(args) -> Any:
    import mlx.core as mx

    from mlxvlm.cpu import ops
    from mlxvlm.models import get_family

    mx.random.seed(0)
    model = get_family("qwen3_5").Model.from_config(model_config(args.hidden, args.layers,
                                                                 args.vocab))
    model.eval()
    mx.eval(model.parameters())
    if not args.no_fast_paths:
        model.cpu_fast_paths = ops.apply_cpu_fast_paths(model)
    return model


def oracle_drafter(model, options, truth: list[int], prompt_length: int):
    """The MTP drafter whose head runs its chain (the cost) but who proposes the plain
    run's next tokens (every draft accepted)."""
    from mlxvlm.generate.mtp_drafter import MtpDrafter

    class Oracle(MtpDrafter):
        def propose(self, context, k):
            drafts, q = super().propose(context, k)
            done = len(context) - prompt_length
            self.drafts = truth[done : done + len(drafts)]
            return self.drafts, q

    return Oracle(model, options)


def one_run(model, inputs, max_tokens: int, k: int | None, truth: list[int] | None):
    """(tokens, decode tokens/s, stats): plain with ``k`` None, else MTP with K = ``k``."""
    from mlxvlm.generate import CacheOptions, generate_tokens
    from mlxvlm.generate.drafters import make_drafter
    from mlxvlm.generate.speculative import SpeculationStats, speculative_tokens
    from mlxvlm.sampling import RowSampler, SamplingOptions

    options = SamplingOptions(max_tokens=max_tokens)
    loop = dict(cache=CacheOptions().make(model, inputs), max_tokens=max_tokens,
                row=RowSampler(options, inputs.input_ids[0]))
    stats = None
    if k is None:
        tokens = generate_tokens(model, inputs, **loop)
    else:
        stats = SpeculationStats()
        drafter = (make_drafter(model, inputs, options, mtp=True, prepare_draft_inputs=None)
                   if truth is None else oracle_drafter(model, options, truth, inputs.num_tokens))
        tokens = speculative_tokens(model, inputs, options=options, drafter=drafter,
                                    num_draft_tokens=k, stats=stats, **loop)
    out, first_at = [], None
    for token, _ in tokens:
        out.append(token)
        if first_at is None:
            first_at = time.perf_counter()
    seconds = time.perf_counter() - first_at
    return out, (len(out) - 1) / seconds, stats


def pass_costs(model, inputs, repeats: int = 7) -> dict[str, float]:
    """Median seconds of a target pass of 1-4 tokens after the prompt and of one head
    step (the recurrent states put back after each pass)."""
    import mlx.core as mx

    from mlxvlm.generate import CacheOptions
    from mlxvlm.generate.rewind import CacheCheckpoint

    cache = CacheOptions().make(model, inputs)
    model(inputs.input_ids, cache, last_only=True)
    mx.eval([c.state for c in cache])
    costs = {}
    for length in (1, 2, 3, 4):
        ids = mx.array([[17] * length])
        times = []
        for _ in range(repeats):
            checkpoint = CacheCheckpoint(cache)
            started = time.perf_counter()
            mx.eval(model(ids, cache))
            times.append(time.perf_counter() - started)
            checkpoint.rewind(cache, 0)
        costs[f"target pass, {length} tokens"] = statistics.median(times)
    target = model.multi_token_predictor()
    head_cache = target.make_cache()
    hidden = target.hidden_states(inputs.input_ids, model.make_cache())
    embedded = target.embed_tokens(inputs.input_ids)
    mx.eval(target.step(embedded[:, 1:], hidden[:, :-1], head_cache, None, 0))
    offset = inputs.num_tokens - 1
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = target.step(embedded[:, -1:], hidden[:, -1:], head_cache, None, offset)
        mx.eval(target.logits(out))
        times.append(time.perf_counter() - started)
        head_cache[0].trim(1)
    costs["MTP head step (with the output head)"] = statistics.median(times)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--no-fast-paths", action="store_true")
    parser.add_argument("--output", default=None, help="also write the raw runs as JSON")
    args = parser.parse_args()

    import mlxvlm  # noqa: F401  (first: it sets up the CPU backend before MLX loads)
    import mlx.core as mx
    import numpy as np

    from mlxvlm.prompt import PreparedInputs

    model = build_model(args)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, args.vocab - 8, size=(1, args.prompt_tokens))
    inputs = PreparedInputs(mx.array(prompt, dtype=mx.int32))
    truth, _, _ = one_run(model, inputs, args.max_tokens, None, None)  # warm-up, reference

    configs = [("plain", None, False)]
    configs += [(f"mtp K={k}", k, False) for k in args.draft_tokens]
    configs += [(f"mtp oracle K={k}", k, True) for k in args.draft_tokens]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    for _ in range(args.runs):
        for name, k, oracle in configs:
            tokens, tps, stats = one_run(model, inputs, args.max_tokens, k,
                                         truth if oracle else None)
            if tokens != truth:
                raise SystemExit(f"{name}: greedy tokens differ from the plain run's")
            runs[name].append({"tokens_per_second": tps, **({} if stats is None else {
                "drafted": stats.drafted, "accepted": stats.accepted,
                "tokens_per_pass": stats.tokens_per_pass})})
    costs = pass_costs(model, inputs)

    params = sum(v.size for _, v in __import__("mlx.utils", fromlist=["tree_flatten"])
                 .tree_flatten(model.language_model.parameters()))
    print(f"Qwen3.5-shaped text model: hidden {args.hidden}, {args.layers} layers, vocab "
          f"{args.vocab}, {params / 1e6:.0f}M parameters (head included); prompt "
          f"{args.prompt_tokens} tokens, {args.max_tokens} new, greedy, {args.runs} runs\n")
    base = statistics.median(r["tokens_per_second"] for r in runs["plain"])
    print("| configuration | decode tokens/s, median (min-max) | vs plain | accepted | "
          "tokens per pass |")
    print("| --- | --- | --- | --- | --- |")
    for name, _, _ in configs:
        speeds = [r["tokens_per_second"] for r in runs[name]]
        median = statistics.median(speeds)
        last = runs[name][-1]
        accepted = (f"{last['accepted']}/{last['drafted']}" if "drafted" in last else "-")
        per_pass = f"{last['tokens_per_pass']:.2f}" if "drafted" in last else "1.00"
        print(f"| {name} | {median:.1f} ({min(speeds):.1f}-{max(speeds):.1f}) | "
              f"{median / base:.2f}x | {accepted} | {per_pass} |")
    print("\n| pass | median ms |\n| --- | --- |")
    for name, seconds in costs.items():
        print(f"| {name} | {1000 * seconds:.1f} |")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"args": vars(args), "runs": runs, "pass_seconds": costs}, handle,
                      indent=2)


if __name__ == "__main__":
    main()
