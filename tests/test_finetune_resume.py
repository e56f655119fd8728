"""Checkpoints and --resume: N steps in one run end with exactly the weights of K steps,
a crash or a kill, and a resumed run of the other N - K steps (same optimizer state, same
data order, same dropout masks); a kill never leaves a checkpoint that cannot be read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

from finetune_helpers import small_dataset
from user_environment import user_environment
from mlxvlm.checkpoint.adapters import WEIGHTS_FILE
from mlxvlm.errors import MlxvlmError
from mlxvlm.finetune import FinetuneConfig, finetune
from mlxvlm.finetune.checkpoints import list_checkpoints, read_checkpoint

FAMILY = "qwen2_vl"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 6 records, batches of 2, 2 batches a step: steps straddle epochs.
    return small_dataset(tmp_path_factory.mktemp("resume-data"), count=6)


def settings(checkpoint, data, output, **overrides) -> FinetuneConfig:
    options = dict(
        model=str(checkpoint), data=str(data), output=str(output), method="lora", rank=4,
        alpha=8, dropout=0.1, batch_size=2, grad_accumulation_steps=2, iters=6,
        learning_rate=2e-3, lr_schedule="cosine", warmup_steps=2, save_every=2, seed=3,
    )
    return FinetuneConfig(**{**options, **overrides})


def trained_tensors(output, method: str) -> dict[str, np.ndarray]:
    name = WEIGHTS_FILE if method != "full" else "model.safetensors"
    return {k: np.array(v) for k, v in mx.load(str(output / name)).items()}


class Crash(Exception):
    pass


class CrashAt:
    """A training callback that dies when a step has been reported."""

    def __init__(self, step: int):
        self.step = step

    def on_train_loss_report(self, info):
        if info["iteration"] == self.step:
            raise Crash(f"crashed after step {self.step}")

    def on_val_loss_report(self, info):
        pass


@pytest.mark.parametrize("method", ["lora", "dora", "full"])
def test_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tiny_checkpoints, tmp_path, data, method):
    checkpoint = tiny_checkpoints.path(FAMILY, "hub")
    finetune(settings(checkpoint, data, tmp_path / "whole", method=method))
    expected = trained_tensors(tmp_path / "whole", method)

    with pytest.raises(Crash):
        finetune(settings(checkpoint, data, tmp_path / "split", method=method), callback=CrashAt(5))
    saved = list_checkpoints(tmp_path / "split")
    assert [p.name for p in saved] == ["step-00000002", "step-00000004"]
    state, optimizer_state = read_checkpoint(saved[-1])
    assert state["step"] == 4 and int(optimizer_state["step"]) == 4

    result = finetune(settings(checkpoint, data, tmp_path / "split", method=method, resume=True))
    assert result.steps == 6
    resumed = trained_tensors(tmp_path / "split", method)
    assert resumed.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)
    # The run really trained: the adapter is not at its initial values.
    if method != "full":
        assert any(np.abs(v).max() > 0 for k, v in expected.items() if "lora_B" in k)


def test_resume_refuses_changed_settings_and_a_fresh_run_refuses_old_checkpoints(
        tiny_checkpoints, tmp_path, data):
    checkpoint = tiny_checkpoints.path(FAMILY, "hub")
    with pytest.raises(Crash):
        finetune(settings(checkpoint, data, tmp_path / "out"), callback=CrashAt(3))
    with pytest.raises(MlxvlmError, match="learning_rate"):
        finetune(settings(checkpoint, data, tmp_path / "out", learning_rate=5e-3, resume=True))
    with pytest.raises(MlxvlmError, match="--resume"):
        finetune(settings(checkpoint, data, tmp_path / "out"))


def test_a_killed_run_resumes_to_the_same_weights(tiny_checkpoints, tmp_path, data):
    """SIGKILL at whatever moment the run has reached (possibly while it writes a
    checkpoint): what is left is readable, and --resume finishes the job exactly as an
    uninterrupted run does. Every run is a CLI process, so all share one environment
    (the same BLAS, hence the same rounding): a user's, torch-free."""
    checkpoint = tiny_checkpoints.path(FAMILY, "hub")
    iters, save_every = 24, 3
    flags = ["--model", str(checkpoint), "--data", str(data), "--rank", "4", "--alpha", "8",
             "--batch-size", "2", "--iters", str(iters), "--learning-rate", "1e-3",
             "--save-every", str(save_every), "--seed", "3"]

    def command(output):
        return [sys.executable, "-m", "mlxvlm.finetune", *flags, "--output", str(output)]

    # The uninterrupted run, the reference, alongside (each start-up takes seconds).
    with (tmp_path / "whole.log").open("w+") as whole_log:
        whole = subprocess.Popen(command(tmp_path / "whole"), stdout=subprocess.DEVNULL,
                                 stderr=whole_log, env=user_environment())
        try:
            killed_and_resumed(command, tmp_path / "killed", save_every)
            returncode = whole.wait(timeout=600)
            whole_log.seek(0)
            assert returncode == 0, whole_log.read()
        finally:
            if whole.poll() is None:
                whole.kill()
                whole.wait()
    expected = trained_tensors(tmp_path / "whole", "lora")
    got = trained_tensors(tmp_path / "killed", "lora")
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def killed_and_resumed(command, output, save_every: int) -> None:
    """The run of ``command`` into ``output``, killed once it has written two checkpoints
    (the kill checked), then resumed to its end."""
    process = subprocess.Popen(command(output), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=user_environment())
    deadline = time.monotonic() + 240
    while len(list_checkpoints(output)) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (output / WEIGHTS_FILE).exists()
    for folder in list_checkpoints(output):  # every checkpoint left is complete
        state, _ = read_checkpoint(folder)
        assert state["step"] % save_every == 0
        assert set(mx.load(str(folder / WEIGHTS_FILE)))

    resumed = subprocess.run(command(output) + ["--resume"], capture_output=True, text=True,
                             timeout=600, env=user_environment())
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert not list((output / "checkpoints").glob(".step-*"))  # the killed run's staging
