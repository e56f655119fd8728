"""Side-by-side benchmark: mlxvlm against mlx-vlm and transformers on the same checkpoint.

    python benchmarks/checkpoints.py                        # build the checkpoints once
    python benchmarks/run.py --checkpoint smolvlm-256m-bf16 --runs 3 \
        --mlx-vlm-python /path/to/venv-with-mlx-vlm/bin/python
    python benchmarks/run.py --checkpoint glm-ocr-bf16 --page 612 --prompt "Text Recognition:" \
        --engines mlxvlm mlxvlm+lookup transformers --max-tokens 128    # OCR pages/min

Every run is a fresh process (so load time and memory are measured from a cold start)
and the engines alternate run by run (in reverse order every other run), so that a slower
or faster stretch of the machine falls on all of them alike. Prints median/min/max of each
statistic and mlxvlm's ratios to the other engines, of the medians and run by run;
``--output`` also writes the raw runs as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINES = HERE / "engines"
CHECKPOINTS = HERE / "checkpoints"

# (label, key, format, higher is better)
METRICS = [
    ("load time (s)", "load_s", ".2f", False),
    ("time to first token (s)", "ttft_s", ".2f", False),
    ("prompt tokens/s", "prompt_tps", ".1f", True),
    ("decode tokens/s", "decode_tps", ".2f", True),
    ("peak RSS (GB)", "max_rss_gb", ".2f", False),
    ("pages/min", "pages_per_min", ".2f", True),
]

# The engine that runs mlxvlm's driver with speculative decoding by prompt lookup
LOOKUP = "mlxvlm+lookup"


def pages_per_min(run: dict) -> float:
    """60 / (time to first token + decode time): one page answered to --max-tokens."""
    decode_s = (run["decode_tokens"] - 1) / run["decode_tps"] if run["decode_tps"] else 0.0
    return 60 / (run["ttft_s"] + decode_s)


def engine_command(engine: str, python: str, checkpoint: Path, image: Path, prompt: str,
                   max_tokens: int, transformers_dtype: str = "float32",
                   prompt_lookup_num_tokens: int = 4) -> list[str]:
    driver = "mlxvlm" if engine == LOOKUP else engine
    script = ENGINES / f"{driver.replace('-', '_')}_engine.py"
    command = [python, str(script), "--model", str(checkpoint), "--image", str(image),
               "--prompt", prompt, "--max-tokens", str(max_tokens)]
    if engine == LOOKUP:
        command += ["--prompt-lookup-num-tokens", str(prompt_lookup_num_tokens)]
    return command + (["--dtype", transformers_dtype] if engine == "transformers" else [])


def run_once(command: list[str], timeout: float) -> dict:
    # The caller's PYTHONPATH stays behind the drivers' folder (a worktree's mlxvlm is measured)
    path = os.pathsep.join(p for p in (str(ENGINES), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    load_average = os.getloadavg()  # each run's, since other work on a shared host comes and goes
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:2])} failed:\n{out.stderr[-3000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    run = json.loads(lines[-1])
    return {**run, "pages_per_min": pages_per_min(run), "load_average": load_average}


def run_order(engines: list[str], index: int) -> list[str]:
    """The engines in the order run ``index`` runs them: reversed every other run, so that
    no engine always runs right after another (whose page cache or idle threads linger)."""
    return list(engines) if index % 2 == 0 else list(reversed(engines))


def _range(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def table(results: dict[str, list[dict]]) -> str:
    """Median (min–max) of each metric per engine; then, for each other engine, the ratio
    of mlxvlm's median to its median, and the run-by-run ratios (run i of mlxvlm against
    run i of the other, minutes or seconds apart), median (min–max): on a machine whose
    speed drifts, the second is the steadier comparison."""
    engines = list(results)
    header = "| metric | " + " | ".join(f"{e} median (min–max)" for e in engines)
    others = [e for e in engines if e != "mlxvlm"]
    header += "".join(f" | mlxvlm ÷ {e} | run by run" for e in others) + " |"
    lines = [header, "|" + " --- |" * (1 + len(engines) + 2 * len(others))]
    for label, key, fmt, _ in METRICS:
        values = {engine: [run[key] for run in results[engine]] for engine in engines}
        cells = [_range(values[engine], fmt) for engine in engines]
        for other in others:
            theirs = statistics.median(values[other])
            ratio = statistics.median(values["mlxvlm"]) / theirs if theirs else float("nan")
            pairs = [a / b for a, b in zip(values["mlxvlm"], values[other]) if b]
            cells += [f"{ratio:.2f}×", _range(pairs, ".2f") if pairs else "–"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def acceptance(results: dict[str, list[dict]]) -> str:
    """Each speculating engine's drafted tokens accepted, over all its runs."""
    lines = []
    for engine, runs in results.items():
        drafted = sum(run.get("drafted", 0) for run in runs)
        if drafted:
            accepted = sum(run.get("accepted", 0) for run in runs)
            lines.append(f"{engine}: {accepted}/{drafted} drafted tokens accepted "
                         f"({100 * accepted / drafted:.1f}%)")
    return "\n".join(lines)


def save(path: Path, results: dict[str, list[dict]], failures: dict[str, str],
         setup: dict | None = None) -> None:
    """The raw runs per engine, each failed engine's error under ``failures``, and what was
    run under ``setup`` (image, prompt, tokens, the host's load average at the start)."""
    path.write_text(json.dumps({**results, **({"failures": failures} if failures else {}),
                                **({"setup": setup} if setup else {})}, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="A directory, or a name under benchmarks/checkpoints/")
    parser.add_argument("--image", type=Path, default=None,
                        help="Default: the checkpoint's benchmark image (448x448)")
    parser.add_argument("--page", type=int, default=None, metavar="WIDTH",
                        help="Read a rendered letter-sized document page this many pixels wide "
                             "instead of --image (page.py; saved beside the checkpoint)")
    parser.add_argument("--prompt", default=None, help="Default: the checkpoint's 87-token prompt")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=4,
                        help=f"Tokens the {LOOKUP} engine drafts by prompt lookup")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["mlxvlm", "mlx-vlm", "transformers"],
                        choices=["mlxvlm", LOOKUP, "mlx-vlm", "transformers"])
    parser.add_argument("--mlx-vlm-python", default=None,
                        help="Interpreter with mlx-vlm installed (skipped when not given)")
    parser.add_argument("--mlx-vlm-checkpoint", default=None,
                        help="The copy mlx-vlm reads, where it needs another config layout "
                             "(mlx_vlm_copy.py; default: --checkpoint)")
    parser.add_argument("--transformers-python", default=sys.executable,
                        help="Interpreter with transformers + torch (default: this one)")
    parser.add_argument("--transformers-dtype", default="float32",
                        choices=["float32", "bfloat16"],
                        help="transformers' weights (default: float32; bfloat16 where float32 "
                             "copies would not fit in memory)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--output", type=Path, default=None, help="Write the raw runs as JSON")
    args = parser.parse_args()

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        checkpoint = CHECKPOINTS / args.checkpoint
    bench = json.loads((checkpoint / "benchmark.json").read_text()) if (
        checkpoint / "benchmark.json").exists() else {}
    image = args.image or checkpoint / bench.get("image", "image.png")
    if args.page:
        from page import document_page, letter_size

        size = letter_size(args.page)
        image = checkpoint / f"page-{size[0]}x{size[1]}.png"
        document_page(*size).save(image)
    prompt = args.prompt or bench.get("prompt") or "Describe this image in detail."

    pythons = {"mlxvlm": sys.executable, LOOKUP: sys.executable, "mlx-vlm": args.mlx_vlm_python,
               "transformers": args.transformers_python}
    engines = [e for e in args.engines if pythons.get(e)]
    skipped = [e for e in args.engines if e not in engines]
    if skipped:
        print(f"skipping (no interpreter given): {', '.join(skipped)}", file=sys.stderr)

    results: dict[str, list[dict]] = {e: [] for e in engines}
    setup = {"checkpoint": checkpoint.name, "image": Path(image).name, "prompt": prompt,
             "max_tokens": args.max_tokens, "load_average": os.getloadavg()}
    failures: dict[str, str] = {}  # an engine that fails is reported and left out of later runs
    for index in range(args.runs):
        for engine in run_order([e for e in engines if e not in failures], index):
            path = Path(args.mlx_vlm_checkpoint) if (
                engine == "mlx-vlm" and args.mlx_vlm_checkpoint) else checkpoint
            command = engine_command(engine, pythons[engine], path, image, prompt,
                                     args.max_tokens, args.transformers_dtype,
                                     args.prompt_lookup_num_tokens)
            try:
                run = run_once(command, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                failures[engine] = f"run {index + 1}: {str(error)[-2000:]}"
                print(f"run {index + 1}/{args.runs} {engine} FAILED: {error}", file=sys.stderr)
                continue
            results[engine].append(run)
            print(f"run {index + 1}/{args.runs} {engine}: ttft {run['ttft_s']:.2f} s, "
                  f"decode {run['decode_tps']:.2f} tok/s, {run['pages_per_min']:.2f} pages/min, "
                  f"rss {run['max_rss_gb']:.2f} GB, load average {run['load_average'][0]:.1f}",
                  file=sys.stderr, flush=True)
            if args.output:  # after every run, so that an interrupted series keeps its runs
                save(args.output, results, failures, setup)

    measured = {engine: runs for engine, runs in results.items() if runs}
    print(f"checkpoint: {checkpoint.name}, prompt tokens (mlxvlm): "
          f"{measured['mlxvlm'][0]['prompt_tokens'] if 'mlxvlm' in measured else '?'}, "
          f"new tokens: {args.max_tokens}, runs: {args.runs}\n")
    print(f"image: {image.name}")
    if "mlxvlm" in measured:
        print(table(measured))
        print(acceptance(measured))
    for engine, error in failures.items():
        print(f"\n{engine} failed on {error}")
    if args.output:
        save(args.output, results, failures, setup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
