"""mlxvlm on the benchmark checkpoint: the same code path as `python -m mlxvlm.benchmark`."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

# A user's install has no torch (it is a test-only dependency); hide the one this venv
# may have, so that transformers does not import it (seconds of load time, ~250 MB).
sys.modules["torch"] = None

from common import parse_args  # noqa: E402

from mlxvlm.benchmark import measure  # noqa: E402

args = parse_args()
options = ({"prompt_lookup_num_tokens": args.prompt_lookup_num_tokens}
           if args.prompt_lookup_num_tokens else {})
for run in measure(args.model, [args.image], args.prompt, args.max_tokens, args.runs,
                   ignore_eos=True, generate_options=options):
    print(json.dumps(asdict(run)), flush=True)
