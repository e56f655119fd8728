"""Decode speed with and without speculative decoding, in one process.

    python benchmarks/checkpoints.py --only smolvlm-256m
    python benchmarks/speculative.py --target smolvlm-256m-bf16 --draft smolvlm-256m-4bit
    python benchmarks/speculative.py --streams 1 4 8   # the batching engine (see below)

For each prompt (the benchmark image with a description prompt, and a copy-heavy text
prompt that asks for a document back) it runs, alternating run by run so that a slow
stretch of a shared host falls on all of them: the plain loop, each draft model, and
prompt lookup. It prints median decode tokens/s (min-max), the speed-up over the plain
loop, the draft acceptance rate and tokens per target pass, and checks that every greedy
run produced the plain loop's tokens.

``--streams N ...``: the batching engine (``max_batch_size`` N) with N text requests
submitted at once (different prompts, greedy, ``--max-tokens`` each), plain and with
batched speculation by: the target as its own draft model (every draft accepted: the
upper bound of acceptance), the target with its output head's rows rolled by one (the
same drafting cost, every draft rejected: the cost), and prompt lookup; each drafting on
every step, or as the engine's rule decides; alternating run by run. Tokens/s counts the
tokens delivered once every stream is decoding (the prefills behind), over the time to
the last; "verify-bound" leaves out the seconds spent drafting (what a free drafter of
the same acceptance would give). It also times one target pass of B
rows x L tokens, what the engine's on/off rule (``batching/speculation_rule.py``) rests
on.
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


def batch_pass_cost(model, rows=(1, 4, 8), lengths=(1, 4), context=96,
                    repeats=5) -> dict[tuple[int, int], float]:
    """Median seconds of one target pass of ``rows`` x ``lengths`` tokens over a
    ``context``-token batched cache, trimmed back after each."""
    import time

    import mlx.core as mx

    from mlxvlm.batching.decode import add_row

    costs = {}
    for b in rows:
        cache = None
        for _ in range(b):
            row = model.make_cache()
            model(mx.array([[5] * context]), row)
            cache = add_row(cache, row)
        mx.eval([c.state for c in cache])
        for length in lengths:
            ids = mx.array([[17] * length] * b)
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                mx.eval(model(ids, cache))
                times.append(time.perf_counter() - started)
                for c in cache:
                    c.trim(length)
            costs[(b, length)] = statistics.median(times)
    return costs


def streams_main(args) -> int:
    import os
    import time

    import mlx.core as mx

    from mlxvlm import load
    from mlxvlm.batching import BatchEngine, SamplingOptions
    from mlxvlm.batching.draft_batch import DraftBatch
    from mlxvlm.batching.speculation_rule import SpeculationRule
    from mlxvlm.generate.drafters import PromptLookupDrafter
    from mlxvlm.generate.speculative import Speculation
    from mlxvlm.prompt import prepare_inputs

    model, processor = load(HERE / "checkpoints" / args.target)
    # The rejected draft: the target with its output head's rows rolled by one, so that
    # each draft is the token after the target's choice (the self-draft's cost, rejected).
    rolled, _ = load(HERE / "checkpoints" / args.target)
    head = rolled.language_model.lm_head
    head.weight = mx.roll(head.weight, 1, axis=0)
    mx.eval(head.weight)
    drafting = {"seconds": 0.0}

    def timed(cls, name):
        """Time the drafting a step does (a draft model's batch, prompt lookup)."""
        method = getattr(cls, name)

        def run(*a, **kw):
            started = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                drafting["seconds"] += time.perf_counter() - started
        setattr(cls, name, run)

    timed(DraftBatch, "propose")
    timed(DraftBatch, "update")
    timed(PromptLookupDrafter, "propose")
    k = args.num_draft_tokens
    # (speculation, whether the engine's rule may turn it off): every step drafts, or
    # the rule decides.
    self_draft = Speculation(draft_model=model, num_draft_tokens=k)
    rejected = Speculation(draft_model=rolled, num_draft_tokens=k)
    configs = {"plain": (None, False),
               f"self-draft, K={k}, every step": (self_draft, False),
               f"self-draft, K={k}, rule": (self_draft, True),
               f"rejected draft, K={k}, every step": (rejected, False),
               f"rejected draft, K={k}, rule": (rejected, True)}
    if args.prompt_lookup_num_tokens:
        configs[f"prompt lookup, K={args.prompt_lookup_num_tokens}, rule"] = (
            Speculation(prompt_lookup_num_tokens=args.prompt_lookup_num_tokens), True)
    if args.only:
        configs = {label: c for label, c in configs.items()
                   if label == "plain" or any(part in label for part in args.only)}
    words = [f"w{i}" for i in range(80)]

    def run(streams, config):
        speculation, ruled = config
        engine = BatchEngine(model, processor, max_batch_size=max(streams, 2),
                             speculation=speculation)
        engine.speculation_rule = SpeculationRule(adaptive=ruled)
        delivered = []
        for s in range(streams):
            text = " ".join(words[s * 7 :] + words[: s * 7][:10])
            inputs = prepare_inputs(processor, text, None, feature_names=model.feature_names)
            engine.submit(inputs, SamplingOptions(max_tokens=args.max_tokens), delivered.append)
        # The window opens once every stream is admitted and prefilled (a stream may
        # already have finished).
        while engine.has_work and (engine.stats.waiting or engine._prefilling is not None
                                   or engine.stats.requests_finished + engine.stats.active
                                   < streams):
            engine.step()
        before = len(delivered)
        drafting["seconds"] = 0.0
        started = time.perf_counter()
        while engine.has_work:
            engine.step()
        seconds = time.perf_counter() - started
        return len(delivered) - before, seconds, drafting["seconds"], engine.stats

    costs = batch_pass_cost(model)
    print(f"one target pass, {args.target}, ms (÷ the same rows' one-token pass)")
    lengths = sorted({length for _, length in costs})
    print("| rows | " + " | ".join(f"L={length}" for length in lengths) + " |")
    print("| --- |" + " --- |" * len(lengths))
    for b in sorted({b for b, _ in costs}):
        print(f"| {b} | " + " | ".join(
            f"{1000 * costs[(b, n)]:.1f} ({costs[(b, n)] / costs[(b, 1)]:.2f}×)"
            for n in lengths) + " |")
    raw = {"target": args.target, "max_tokens": args.max_tokens,
           "pass_seconds": {f"{b}x{n}": t for (b, n), t in costs.items()},
           "load_average_before": os.getloadavg(), "streams": {}}
    run(1, (None, False))  # warm-up
    print()
    print(f"{args.max_tokens} new tokens a stream, {args.runs} alternating runs; load "
          f"average {os.getloadavg()[0]:.1f}")
    print("| streams | decoding | tokens/s | speed-up | verify-bound tokens/s | accepted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for streams in args.streams:
        rates = {label: [] for label in configs}
        bound = {label: [] for label in configs}
        accepted = {}
        for i in range(args.runs):
            order = list(configs) if i % 2 == 0 else list(reversed(configs))
            for label in order:
                tokens, seconds, drafted_seconds, stats = run(streams, configs[label])
                rates[label].append(tokens / seconds)
                bound[label].append(tokens / max(seconds - drafted_seconds, 1e-9))
                accepted[label] = (stats.accepted_draft_tokens, stats.drafted_tokens)
        base = statistics.median(rates["plain"])
        raw["streams"][streams] = {label: {"tokens_per_second": rates[label],
                                           "verify_bound": bound[label],
                                           "accepted_drafted": accepted[label]}
                                   for label in configs}
        for label in configs:
            median = statistics.median(rates[label])
            a, d = accepted[label]
            share = f"{100 * a / d:.0f}%" if d else "-"
            print(f"| {streams} | {label} | {median:.1f} ({min(rates[label]):.1f}–"
                  f"{max(rates[label]):.1f}) | {median / base:.2f}× | "
                  f"{statistics.median(bound[label]):.1f} | {share} |", flush=True)
    raw["load_average_after"] = os.getloadavg()
    if args.output:
        import json

        Path(args.output).write_text(json.dumps(raw, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smolvlm-256m-bf16")
    parser.add_argument("--draft", nargs="*", default=["smolvlm-256m-4bit", "smolvlm-256m-8bit"])
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", default=None, help="also write the raw runs as JSON here")
    parser.add_argument("--streams", nargs="*", type=int, default=None,
                        help="the batching engine with these numbers of streams (see above)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="with --streams: only the decodings whose label holds one of "
                        "these (and plain), e.g. 'every step'")
    args = parser.parse_args()
    if args.streams:
        return streams_main(args)

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
