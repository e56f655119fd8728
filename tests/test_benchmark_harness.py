"""benchmarks/run.py's run order and table (the engines themselves run in benchmarks/)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

RUN_PY = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"


def _harness():
    spec = importlib.util.spec_from_file_location("benchmark_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(ttft: float, decode: float) -> dict:
    return {"load_s": 1.0, "ttft_s": ttft, "prompt_tps": 100 / ttft, "decode_tps": decode,
            "max_rss_gb": 0.5}


def test_engines_alternate_and_reverse_every_other_run():
    harness = _harness()
    engines = ["mlxvlm", "mlx-vlm", "transformers"]
    assert harness.run_order(engines, 0) == engines
    assert harness.run_order(engines, 1) == ["transformers", "mlx-vlm", "mlxvlm"]
    assert harness.run_order(engines, 2) == engines
    assert engines == ["mlxvlm", "mlx-vlm", "transformers"]  # not reversed in place


def test_table_gives_the_ratio_of_medians_and_the_run_by_run_ratios():
    harness = _harness()
    # The machine drifts: each run of both engines is slower than the one before.
    results = {
        "mlxvlm": [_run(1.0, 20.0), _run(2.0, 10.0), _run(4.0, 5.0)],
        "transformers": [_run(1.25, 10.0), _run(2.5, 5.0), _run(3.2, 4.0)],
    }
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")
            for line in harness.table(results).splitlines()}
    assert rows["metric"][-2:] == ["mlxvlm ÷ transformers", "run by run |"]
    ttft = rows["time to first token (s)"]
    assert ttft[1] == "2.00 (1.00–4.00)" and ttft[2] == "2.50 (1.25–3.20)"
    assert ttft[3] == "0.80×"  # 2.00 / 2.50
    # 1.0/1.25, 2.0/2.5, 4.0/3.2: median 0.80, min 0.80, max 1.25
    assert ttft[4] == "0.80 (0.80–1.25) |"
    decode = rows["decode tokens/s"]
    assert decode[3] == "2.00×" and decode[4] == "2.00 (1.25–2.00) |"
