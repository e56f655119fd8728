"""mlxvlm on the benchmark checkpoint: the same code path as `python -m mlxvlm.benchmark`."""

from __future__ import annotations

import json
from dataclasses import asdict

from common import parse_args

from mlxvlm.benchmark import measure

args = parse_args()
for run in measure(args.model, [args.image], args.prompt, args.max_tokens, args.runs, ignore_eos=True):
    print(json.dumps(asdict(run)), flush=True)
