"""Start-up of the demo with transformers' torch support on (MLXVLM_ALLOW_TORCH=1: what
every run did before mlxvlm kept torch out) and off (the default), in alternating fresh
processes: import, load and first-token times, whole-run wall time and peak RSS.

    python benchmarks/startup.py --model examples/shapes-vlm --runs 5 --out benchmarks/results/DATE-HOST/startup-demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = """
import json, resource, sys, time
start = time.perf_counter()
import mlxvlm
imported = time.perf_counter()
model, processor = mlxvlm.load(sys.argv[1])
loaded = time.perf_counter()
first = None
text = []
for result in mlxvlm.stream_generate(model, processor, sys.argv[3], sys.argv[2], max_tokens=32):
    first = first or time.perf_counter()
    text.append(result.text)
done = time.perf_counter()
print(json.dumps({
    "import_s": imported - start, "load_s": loaded - imported, "first_token_s": first - loaded,
    "generate_s": done - loaded, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "torch_imported": "torch" in sys.modules, "text": "".join(text),
}))
"""

MODES = {"torch (before)": "1", "torch-free (after)": "0"}


def run_once(model: str, image: str, prompt: str, allow_torch: str) -> dict:
    env = dict(os.environ, MLXVLM_ALLOW_TORCH=allow_torch)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, image, prompt],
        env=env, capture_output=True, text=True, check=True,
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["process_wall_s"] = time.perf_counter() - start
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/shapes-vlm")
    parser.add_argument("--image", default="examples/images/red-circle.png")
    parser.add_argument("--prompt", default="What is in the picture?")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    run_once(args.model, args.image, args.prompt, "0")  # warm the file cache
    for _ in range(args.runs):
        for mode, allow in MODES.items():
            runs[mode].append(run_once(args.model, args.image, args.prompt, allow))
    keys = ["import_s", "load_s", "first_token_s", "process_wall_s", "peak_rss_mb"]
    summary = {
        mode: {key: round(statistics.median(r[key] for r in rs), 3) for key in keys}
        | {"torch_imported": [r["torch_imported"] for r in rs], "text": rs[0]["text"]}
        for mode, rs in runs.items()
    }
    result = {
        "what": "median of alternating fresh-process runs of the demo (import, load, stream_generate)",
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "model": args.model, "image": args.image, "prompt": args.prompt, "runs": args.runs,
        "load_average_at_end": os.getloadavg(), "summary": summary, "all_runs": runs,
    }
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
