"""Decode speed with and without speculative decoding, in one process.

    python benchmarks/checkpoints.py --only smolvlm-256m
    python benchmarks/speculative.py --target smolvlm-256m-bf16 --draft smolvlm-256m-4bit

For each prompt (the benchmark image with a description prompt, and a copy-heavy text
prompt that asks for a document back) it runs, alternating run by run so that a slow
stretch of a shared host falls on all of them: the plain loop, each draft model, and
prompt lookup. It prints median decode tokens/s (min-max), the speed-up over the plain
loop, the draft acceptance rate and tokens per target pass, and checks that every greedy
run produced the plain loop's tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checkpoints import benchmark_image  # noqa: E402

DOCUMENT = (
    "Invoice 4471. Date: 2026-03-14. Bill to: Northwind Traders, 12 Harbour Road, Leith. "
    "Item 1: 40 boxes of printer paper at 4.20 each, 168.00. Item 2: 6 toner cartridges at "
    "38.50 each, 231.00. Item 3: 2 office chairs at 119.00 each, 238.00. Subtotal 637.00, "
    "tax 127.40, total 764.40. Payment due within 30 days to account 0042 7781 5530."
)


def prompts(image) -> dict[str, tuple[str, object]]:
    return {
        "image, describe": ("Describe this image.", image),
        "copy a document": (f"Copy this text exactly:\n\n{DOCUMENT}", None),
    }


def one_run(model, processor, prompt, image, max_tokens, **options):
    from mlxvlm import stream_generate

    tokens, last = [], None
    for last in stream_generate(model, processor, prompt, image, max_tokens=max_tokens, **options):
        tokens.append(last.token)
    return tokens, last


def pass_cost(model, processor, image, lengths=(1, 2, 3, 4, 5, 8), repeats=9) -> dict[int, float]:
    """Median seconds of one target pass of each length after the image prompt, the cache
    trimmed back after each: what a verification pass of K + 1 tokens costs against a
    one-token step."""
    import time

    import mlx.core as mx

    from mlxvlm.generate import CacheOptions
    from mlxvlm.generate.loop import embed_prompt
    from mlxvlm.prompt import prepare_inputs

    inputs = prepare_inputs(processor, "Describe this image.", image,
                            feature_names=model.feature_names)
    cache = CacheOptions().make(model, inputs)
    embeddings, state = embed_prompt(model, inputs.input_ids, **inputs.features)
    model(inputs.input_ids, cache, embeddings=embeddings, state=state, last_only=True)
    mx.eval([c.state for c in cache])
    costs = {}
    for length in lengths:
        ids = mx.array([[17] * length])
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            mx.eval(model(ids, cache, state=state))
            times.append(time.perf_counter() - started)
            for c in cache:
                c.trim(length)
        costs[length] = statistics.median(times)
    return costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smolvlm-256m-bf16")
    parser.add_argument("--draft", nargs="*", default=["smolvlm-256m-4bit", "smolvlm-256m-8bit"])
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", default=None, help="also write the raw runs as JSON here")
    args = parser.parse_args()

    from mlxvlm import load

    target = load(HERE / "checkpoints" / args.target)
    configs = {"plain": {}}
    for name in args.draft:
        configs[f"draft {name}, K={args.num_draft_tokens}"] = dict(
            draft_model=load(HERE / "checkpoints" / name), num_draft_tokens=args.num_draft_tokens)
    configs |= {
        f"prompt lookup, K={args.prompt_lookup_num_tokens}": dict(
            prompt_lookup_num_tokens=args.prompt_lookup_num_tokens),
    }
    costs = pass_cost(*target, benchmark_image())
    raw = {"target": args.target, "max_tokens": args.max_tokens, "pass_seconds": costs,
           "prompts": {}}
    print("| tokens in one target pass | " + " | ".join(map(str, costs)) + " |")
    print("| --- |" + " --- |" * len(costs))
    print("| ms (÷ one-token pass) | " + " | ".join(
        f"{1000 * t:.1f} ({t / costs[1]:.2f}×)" for t in costs.values()) + " |")
    print()
    print(f"target {args.target}, {args.max_tokens} new tokens, {args.runs} alternating runs")
    print("| prompt | decoding | decode tokens/s | speed-up | accepted | tokens/pass | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (prompt, image) in prompts(benchmark_image()).items():
        one_run(*target, prompt, image, 4)  # warm-up: kernels built, caches touched
        speeds = {label: [] for label in configs}
        stats, same = {}, {}
        reference = None
        for run in range(args.runs):
            order = list(configs) if run % 2 == 0 else list(reversed(configs))
            for label in order:
                tokens, last = one_run(*target, prompt, image, args.max_tokens, **configs[label])
                reference = tokens if label == "plain" and reference is None else reference
                speeds[label].append(last.generation_tps)
                stats[label] = last.speculation
                same.setdefault(label, []).append(tokens)
        raw["prompts"][name] = {label: {
            "decode_tps": speeds[label],
            "drafted": stats[label].drafted if stats[label] else 0,
            "accepted": stats[label].accepted if stats[label] else 0,
            "target_passes": stats[label].target_passes if stats[label] else None,
            "same_tokens": all(t == reference for t in same[label]),
        } for label in configs}
        base = statistics.median(speeds["plain"])
        for label, values in speeds.items():
            median = statistics.median(values)
            spec = stats[label]
            accepted = f"{100 * spec.acceptance_rate:.0f}%" if spec else "-"
            per_pass = f"{spec.tokens_per_pass:.2f}" if spec else "1.00"
            identical = all(t == reference for t in same[label])
            print(f"| {name} | {label} | {median:.1f} ({min(values):.1f}–{max(values):.1f}) | "
                  f"{median / base:.2f}× | {accepted} | {per_pass} | {'yes' if identical else 'NO'} |",
                  flush=True)
    if args.output:
        import json

        Path(args.output).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
