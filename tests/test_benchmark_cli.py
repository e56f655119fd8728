"""`python -m mlxvlm.benchmark` reports every statistic, per run with --json."""

from __future__ import annotations

import json

from tiny import make_image
from mlxvlm.benchmark import main


def test_benchmark_json_and_summary(tiny_checkpoints, tmp_path, capsys):
    image = tmp_path / "image.png"
    make_image(112, 84, seed=1).save(image)
    model = str(tiny_checkpoints.path("qwen2_vl", "hub"))
    args = ["--model", model, "--image", str(image), "--max-tokens", "6", "--ignore-eos"]
    assert main([*args, "--runs", "2", "--json"]) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(runs) == 2
    for run in runs:
        assert run["engine"] == "mlxvlm" and run["decode_tokens"] == 6
        assert run["prompt_tokens"] > 12 and run["ttft_s"] > 0 and run["decode_tps"] > 0
        assert run["peak_memory_gb"] > 0 and run["max_rss_gb"] > 0
    assert main([*args, "--runs", "1"]) == 0
    summary = capsys.readouterr().out
    for label in ("time to first token", "decode tokens/s", "peak memory", "median"):
        assert label in summary


def test_every_run_encodes_the_picture(tiny_checkpoints, tmp_path, monkeypatch):
    """Later runs time the vision tower too: none takes the first run's features from
    the model's feature cache."""
    from mlxvlm.benchmark import measure
    from mlxvlm.models.feature_cache import FeatureCache

    lookups = []
    original = FeatureCache.get

    def get(self, key):
        found = original(self, key)
        lookups.append(found is not None)
        return found

    monkeypatch.setattr(FeatureCache, "get", get)
    image = tmp_path / "image.png"
    make_image(112, 84, seed=1).save(image)
    measure(str(tiny_checkpoints.path("qwen2_vl", "hub")), [str(image)], "Describe.", 2, 3)
    assert len(lookups) >= 3 and not any(lookups), lookups


def test_measure_passes_speculation_options_and_counts_the_drafts(tiny_checkpoints, tmp_path):
    from mlxvlm.benchmark import measure

    image = tmp_path / "image.png"
    make_image(112, 84, seed=1).save(image)
    model = str(tiny_checkpoints.path("qwen2_vl", "hub"))
    plain, = measure(model, [str(image)], "w1 w2 w3 w1 w2 w3 w1 w2 w3", 12, 1, ignore_eos=True)
    lookup, = measure(model, [str(image)], "w1 w2 w3 w1 w2 w3 w1 w2 w3", 12, 1, ignore_eos=True,
                      generate_options={"prompt_lookup_num_tokens": 3})
    assert plain.drafted == plain.accepted == 0
    assert lookup.decode_tokens == 12 and 0 <= lookup.accepted <= lookup.drafted
    # The model drafting for itself: every drafted token is kept, and counted
    selfdraft, = measure(model, [str(image)], "Describe.", 12, 1, ignore_eos=True,
                         generate_options={"draft_model": model, "num_draft_tokens": 3})
    assert selfdraft.decode_tokens == 12 and selfdraft.accepted == selfdraft.drafted > 0


def test_benchmark_bad_model_is_a_one_line_error(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing"), "--runs", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
