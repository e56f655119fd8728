"""What a grammar costs before and while it runs: compiling it and walking its closing
path through a whole answer (the server does both before a request takes a slot), the
grammar's CPU time per generated token, and the memory a reloaded tokenizer's grammar
view holds.

    python benchmarks/grammar_admission.py                       # the BPE checkpoint's tokenizer
    python benchmarks/grammar_admission.py --tokenizer DIR --eos "</s>"

The tokenizer defaults to ``bpe_checkpoint.py``'s (a 49152-entry byte-level BPE, a real
model's size); where that checkpoint is missing, its tokenizer is trained here alone.
The per-token figure feeds the processor random logits (no model), greedily, so it is
the grammar's own work: its matcher, its mask and the closing checks near the budget.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = HERE / "checkpoints" / "smolvlm-256m-bpe"
TRAINED = HERE / "checkpoints" / "bpe-tokenizer"

OBJECT = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}
WIDE = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                   "required": [f"k{i}"], "additionalProperties": False}
                  for i in range(5000)]}
# (label, schema, max_tokens)
CASES = [
    ("object, 3 properties", OBJECT, 512),
    ('string, "pattern": "^a+b$"', {"type": "string", "pattern": "^a+b$"}, 16),
    ("array, minItems 1000", {"type": "array", "items": {"type": "integer"},
                              "minItems": 1000}, 4096),
    ("array, minItems 5000", {"type": "array", "items": {"type": "integer"},
                              "minItems": 5000}, 16),
    ("300 strings of minLength 30", {"type": "array", "minItems": 300, "items": {
        "type": "string", "minLength": 30}}, 20000),
    ("anyOf of 5000 objects", WIDE, 512),
]


def load_tokenizer(path: Path | None):
    from transformers import AutoTokenizer

    if path is not None:
        return AutoTokenizer.from_pretrained(path)
    if (DEFAULT / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(DEFAULT)
    if not (TRAINED / "tokenizer.json").exists():
        sys.path.insert(0, str(HERE))
        from bpe_checkpoint import train_tokenizer

        train_tokenizer({"<end_of_utterance>": 49152}).save_pretrained(TRAINED)
    return AutoTokenizer.from_pretrained(TRAINED)


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def admission(tokenizer, eos: list[int]) -> None:
    from mlxvlm.sampling.constrained import ConstraintError, json_schema_constraint

    print("| grammar | max_tokens | compile (s) | closing walk (s) | outcome |")
    print("| --- | --- | --- | --- | --- |")
    for label, schema, max_tokens in CASES:
        start = time.perf_counter()
        try:
            constraint = json_schema_constraint(tokenizer, eos, schema)
        except ConstraintError as error:
            print(f"| {label} | {max_tokens} | {time.perf_counter() - start:.2f} | — | "
                  f"refused: {str(error)[:60]} |")
            continue
        compiled = time.perf_counter()
        try:
            outcome = f"{constraint.check_budget(max_tokens)} tokens"
        except ConstraintError as error:
            outcome = f"refused ({error.reason}): {str(error)[:60]}"
        walked = time.perf_counter()
        print(f"| {label} | {max_tokens} | {compiled - start:.2f} | {walked - compiled:.2f} "
              f"| {outcome} |")


def per_token(tokenizer, eos: list[int], runs: int) -> None:
    import mlx.core as mx
    import numpy as np

    from mlxvlm.sampling.constrained import json_schema_constraint

    rng = np.random.default_rng(0)
    print("| grammar | max_tokens | tokens | grammar CPU per token (ms) |")
    print("| --- | --- | --- | --- |")
    for label, schema, max_tokens in [("any JSON object", None, 64),
                                      ("object, 3 properties", OBJECT, 64),
                                      ("object, 3 properties", OBJECT, 300)]:
        times, count = [], 0
        for _ in range(runs):
            processor = json_schema_constraint(tokenizer, eos, schema).processor(max_tokens)
            history, count = [eos[0]], 0
            started = time.thread_time()
            for _ in range(max_tokens):
                logits = mx.array(rng.normal(size=(1, len(tokenizer))).astype(np.float32))
                token = int(mx.argmax(processor(mx.array([history]), logits), -1).item())
                count += 1
                if token in eos:
                    break
                history.append(token)
            times.append(1000 * (time.thread_time() - started) / count)
            json.loads(tokenizer.decode(history[1:]))  # closed within the budget
        print(f"| {label} | {max_tokens} | {count} | {statistics.median(times):.2f} "
              f"({min(times):.2f}-{max(times):.2f}) |")


def reloads(path: Path | None, eos_text: str, cycles: int) -> None:
    """A server switching models: each cycle loads a tokenizer, uses it for structured
    output, then drops the one before it. Resident memory after each cycle, and how many
    grammar tokenizers are still held at the end."""
    import mlx.core as mx

    from mlxvlm.sampling import constrained

    sizes, previous = [], None
    for _ in range(cycles):
        tokenizer = load_tokenizer(path)
        eos = [tokenizer.convert_tokens_to_ids(eos_text)]
        processor = constrained.json_schema_constraint(tokenizer, eos, OBJECT).processor(64)
        processor(mx.array([[eos[0]]]), mx.zeros((1, len(tokenizer))))  # + closing
        del processor, previous
        previous = tokenizer
        del tokenizer
        gc.collect()
        sizes.append(rss_mb())
    print("resident MB after each reload: " + ", ".join(f"{s:.0f}" for s in sizes))
    print(f"grammar tokenizers held for {cycles} reloads: "
          f"{len(constrained._GRAMMAR_TOKENIZERS)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--eos", default="<|im_end|>")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reloads", type=int, default=5)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    eos = [tokenizer.convert_tokens_to_ids(args.eos)]
    print(f"{len(tokenizer)} tokens")
    admission(tokenizer, eos)
    per_token(tokenizer, eos, args.runs)
    del tokenizer
    reloads(args.tokenizer, args.eos, args.reloads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
