"""`python -m mlxvlm.benchmark`: time a model on this machine.

Loads the model, then runs the same prompt and image ``--runs`` times and reports the
median, min and max of: load time, time to first token (preprocessing, vision encoding
and prefill), prompt tokens/s, decode tokens/s and peak memory. ``--json`` prints one JSON
object per run instead (the cross-engine harness in ``benchmarks/`` reads those).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Sequence

from mlxvlm.cli import OneLineParser, add_model_arguments, ranged, run_cli
from mlxvlm.sampling.ranges import SAMPLING, at_least

DEFAULT_PROMPT = "Describe this image in detail."


@dataclass
class RunStats:
    engine: str
    load_s: float
    ttft_s: float
    prompt_tokens: int
    prompt_tps: float
    decode_tokens: int
    decode_tps: float
    peak_memory_gb: float  # MLX's allocator peak (or the engine's own measure)
    max_rss_gb: float  # the process's resident-set high-water mark (comparable across engines)
    # With speculative decoding (prompt lookup, a draft model): tokens proposed and kept
    drafted: int = 0
    accepted: int = 0


def max_rss_gb() -> float:
    kilobytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kilobytes * (1 if sys.platform == "darwin" else 1024) / 1e9


def time_generation(model, processor, prompt, images, max_tokens: int, ignore_eos: bool,
                    **generate_options):
    """One generation: (time to first token, prompt tokens, decode tokens, decode s, peak,
    the last result's speculation statistics or None); ``generate_options`` go to
    ``stream_generate`` (``prompt_lookup_num_tokens``, for instance)."""
    from mlxvlm.generate import stream_generate
    from mlxvlm.text.tokenization import processor_state

    state = processor_state(processor)
    saved_eos = state.eos_token_ids
    if ignore_eos:  # time exactly max_tokens, whatever a random checkpoint samples
        state.eos_token_ids = {-1}
    try:
        start = time.perf_counter()
        first = last = None
        count = 0
        for result in stream_generate(model, processor, prompt, images, max_tokens=max_tokens,
                                      **generate_options):
            now = time.perf_counter()
            first = first or now
            last, count, final = now, count + 1, result
    finally:
        state.eos_token_ids = saved_eos
    decode_s = (last - first) if count > 1 else 0.0
    return first - start, final.prompt_tokens, count, decode_s, final.peak_memory, final.speculation


def measure(model_path: str, images: list, prompt: str, max_tokens: int, runs: int,
            ignore_eos: bool = False, generate_options: dict | None = None,
            **load_options) -> list[RunStats]:
    from mlxvlm.checkpoint.loading import load
    from mlxvlm.media import load_image

    pictures = [load_image(source) for source in images]
    start = time.perf_counter()
    model, processor = load(model_path, **load_options)
    load_s = time.perf_counter() - start
    stats = []
    for _ in range(runs):
        # Each run encodes its pictures afresh, as a new request does: a later run must not
        # take the features the first one left in the model's feature cache.
        model.feature_cache.clear()
        ttft, prompt_tokens, count, decode_s, peak, speculation = time_generation(
            model, processor, prompt, pictures, max_tokens, ignore_eos, **(generate_options or {})
        )
        stats.append(
            RunStats(
                engine="mlxvlm",
                load_s=load_s,
                ttft_s=ttft,
                prompt_tokens=prompt_tokens,
                prompt_tps=prompt_tokens / ttft,
                decode_tokens=count,
                decode_tps=(count - 1) / decode_s if decode_s > 0 else 0.0,
                peak_memory_gb=peak,
                max_rss_gb=max_rss_gb(),
                drafted=speculation.drafted if speculation else 0,
                accepted=speculation.accepted if speculation else 0,
            )
        )
    return stats


def summarize(stats: Sequence[RunStats]) -> str:
    rows = [
        ("load time (s)", "load_s", ".2f"),
        ("time to first token (s)", "ttft_s", ".2f"),
        ("prompt tokens/s", "prompt_tps", ".1f"),
        ("decode tokens/s", "decode_tps", ".2f"),
        ("peak memory (GB)", "peak_memory_gb", ".3f"),
        ("max RSS (GB)", "max_rss_gb", ".3f"),
    ]
    lines = [f"{len(stats)} run(s), {stats[0].prompt_tokens} prompt tokens, "
             f"{stats[0].decode_tokens} generated tokens",
             f"{'':26} {'median':>9} {'min':>9} {'max':>9}"]
    for label, key, fmt in rows:
        values = [getattr(s, key) for s in stats]
        lines.append(
            f"{label:26} {statistics.median(values):>9{fmt}} {min(values):>9{fmt}} {max(values):>9{fmt}}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m mlxvlm.benchmark", description="Time a vision-language model."
    )
    add_model_arguments(parser)
    parser.add_argument("--image", action="extend", nargs="+", default=[],
                        help="Image path, URL or data URL (repeatable)")
    parser.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="The prompt")
    parser.add_argument("--max-tokens", "-m", type=ranged(SAMPLING["max_tokens"]), default=64,
                        help="New tokens per run")
    parser.add_argument("--runs", type=ranged(at_least(1)), default=3,
                        help="Generations to time")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="Always generate --max-tokens tokens (for random checkpoints)")
    parser.add_argument("--json", action="store_true", help="One JSON object per run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        stats = measure(
            args.model, args.image, args.prompt, args.max_tokens, args.runs,
            ignore_eos=args.ignore_eos, revision=args.revision,
            adapter_path=args.adapter_path, trust_remote_code=args.trust_remote_code,
        )
        if args.json:
            for run in stats:
                print(json.dumps(asdict(run)))
        else:
            print(summarize(stats))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    raise SystemExit(main())
