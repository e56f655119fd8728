"""Fine-tuning's progress: tqdm's bar on a terminal, plain lines elsewhere (the CLI run
through a pipe: tests/test_finetune_data.py)."""

from __future__ import annotations

import io
import sys

from tqdm import tqdm

from mlxvlm.progress import PlainProgress, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_the_bar_and_a_file_plain_lines(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    with progress(total=3, desc="Training", unit="step") as bar:
        assert isinstance(bar, tqdm)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress(total=3, desc="Training", unit="step") as bar:
        assert isinstance(bar, PlainProgress)


def test_plain_lines_count_from_where_a_resumed_run_starts():
    out = io.StringIO()
    with PlainProgress(total=4, desc="Training", unit="step", initial=2, every_s=0,
                       file=out) as bar:
        bar.set_postfix(loss="1.500", refresh=False)
        bar.update(1)
        bar.write("step 3: val loss 1.4000 (0.1s)")
        bar.update(1)
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "Training: 3/4 steps (75%)", "step 3: val loss 1.4000 (0.1s)", "Training: 4/4 steps (100%)"]
    assert lines[0].endswith(", loss=1.500") and lines[2].endswith(", loss=1.500")
    assert "\r" not in out.getvalue()


def test_between_intervals_only_the_last_count_is_written():
    out = io.StringIO()
    with PlainProgress(total=500, desc="Checking training records", unit="record",
                       every_s=3600, file=out) as bar:
        for _ in range(500):
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("Checking training records: 500/500 records (100%), ")

    nothing = io.StringIO()
    with PlainProgress(total=5, desc="Training", unit="step", initial=5, file=nothing):
        pass
    assert nothing.getvalue() == ""  # a resumed run that had nothing left to do
