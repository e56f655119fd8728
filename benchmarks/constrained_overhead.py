"""Per-token cost of constrained decoding: decode tokens/s with and without a JSON schema.

    python benchmarks/bpe_checkpoint.py               # once: the byte-level BPE checkpoint
    python benchmarks/constrained_overhead.py --runs 3 --max-tokens 64

On ``smolvlm-256m-bpe`` (SmolVLM-256M's shapes, random weights, a 49152-entry byte-level
BPE: a vocabulary llguidance handles, of a real model's size), ``mlxvlm.generate`` runs a
text prompt greedily, free and under ``json_schema`` (llguidance's mask computed for every
token and applied as the step's last logits processor), alternating run by run. Decode
tokens/s is ``generate``'s own (tokens after the first over the time since the first);
the overhead per token is the difference of the inverse rates, and the grammar's own CPU
time per token (its matcher and mask) is timed apart, which a busy host's swings in
tokens/s do not blur.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = HERE / "checkpoints" / "smolvlm-256m-bpe"
PROMPT = "Give the name, the age and three hobbies of a person as JSON."
SCHEMAS = {
    "any JSON object": True,
    "object schema": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "hobbies": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "hobbies"], "additionalProperties": False},
}


def summary(values: list[float], digits: int = 1) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model} is missing: run benchmarks/bpe_checkpoint.py first")

    import mlxvlm
    from mlxvlm.sampling import constrained

    # The grammar's own work per token (its matcher, the mask), as CPU time of the
    # thread that runs it: waiting for the model's step is not counted, so this holds on
    # a busy host where the tokens/s swing.
    processor_seconds = [0.0, 0]
    unwrapped = constrained.GrammarProcessor.__call__

    def timed(self, history, logits):
        start = time.thread_time()
        out = unwrapped(self, history, logits)
        processor_seconds[0] += time.thread_time() - start
        processor_seconds[1] += 1
        return out

    constrained.GrammarProcessor.__call__ = timed
    model, processor = mlxvlm.load(args.model)
    modes = {"free": None, **SCHEMAS}
    mlxvlm.generate(model, processor, PROMPT, max_tokens=8)  # warm-up
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens: dict[str, list[int]] = {mode: [] for mode in modes}
    grammar_ms: dict[str, list[float]] = {mode: [] for mode in modes}
    for run in range(args.runs):
        order = list(modes) if run % 2 == 0 else list(reversed(modes))
        for mode in order:
            processor_seconds[:] = [0.0, 0]
            output = mlxvlm.generate(model, processor, PROMPT, max_tokens=args.max_tokens,
                                     json_schema=modes[mode])
            rates[mode].append(output.generation_tps)
            tokens[mode].append(len(output.tokens))
            if processor_seconds[1]:
                grammar_ms[mode].append(1000 * processor_seconds[0] / processor_seconds[1])
            if modes[mode] is not None:
                json.loads(output.text)  # the answer is JSON (closed within the budget)
    free = statistics.median(rates["free"])
    print(f"{args.model.name}: {len(processor.tokenizer)} tokens, {args.max_tokens} new, "
          f"{args.runs} alternating runs")
    print("| decoding | tokens generated | decode tokens/s | ÷ free | decode time per token "
          "vs free (ms) | grammar's CPU time per token (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        rate = statistics.median(rates[mode])
        overhead = "" if mode == "free" else f"{(1 / rate - 1 / free) * 1000:+.1f}"
        own = summary(grammar_ms[mode], 2) if grammar_ms[mode] else ""
        print(f"| {mode} | {statistics.median(tokens[mode]):.0f} | {summary(rates[mode])} | "
              f"{rate / free:.2f}× | {overhead} | {own} |")
    if args.output:
        args.output.write_text(json.dumps(
            {"rates": rates, "tokens": tokens, "grammar_ms_per_token": grammar_ms}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
