"""Every setting of a fine-tuning run (the CLI's flags), and the ones a resume must keep."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mlxvlm.errors import MlxvlmError

LR_SCHEDULES = ("constant", "cosine", "linear")
# Without --learning-rate: the usual starting points for adapters and for full weights.
DEFAULT_LEARNING_RATE = {"lora": 1e-4, "dora": 1e-4, "full": 1e-5}


@dataclass
class FinetuneConfig:
    model: str
    data: str
    val_data: str | None = None
    output: str = "adapters"
    method: str = "lora"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None
    num_layers: int = -1  # the last N decoder blocks; -1: all
    train_vision: bool = False
    batch_size: int = 4
    grad_accumulation_steps: int = 1
    iters: int | None = None  # optimizer steps; with neither iters nor epochs: 1 epoch
    epochs: float | None = None
    learning_rate: float | None = None  # None: DEFAULT_LEARNING_RATE[method]
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    max_seq_length: int = 2048
    grad_checkpoint: bool = False
    steps_per_eval: int = 200
    val_batches: int = 25  # -1: the whole validation set
    save_every: int = 100
    resume: bool = False
    seed: int = 0
    skip_bad_records: bool = False
    revision: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self):
        if self.iters is not None and self.epochs is not None:
            raise MlxvlmError("give --iters or --epochs, not both")
        checks = {
            "--batch-size": self.batch_size >= 1,
            "--grad-accumulation-steps": self.grad_accumulation_steps >= 1,
            "--iters": self.iters is None or self.iters >= 1,
            "--epochs": self.epochs is None or self.epochs > 0,
            "--max-seq-length": self.max_seq_length >= 2,
            "--warmup-steps": self.warmup_steps >= 0,
            "--save-every": self.save_every >= 1,
            "--steps-per-eval": self.steps_per_eval >= 1,
            "--dropout": 0.0 <= self.dropout < 1.0,
        }
        bad = [flag for flag, ok in checks.items() if not ok]
        if bad:
            raise MlxvlmError(f"out of range: {', '.join(bad)} (see --help)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise MlxvlmError(
                f"--lr-schedule {self.lr_schedule!r} is unknown (choose from {', '.join(LR_SCHEDULES)})"
            )
        if self.learning_rate is None:
            self.learning_rate = DEFAULT_LEARNING_RATE.get(self.method, 1e-5)

    def trajectory(self) -> dict:
        """The settings that decide which weights a run ends with: a resumed run must
        have the same ones."""
        skip = {"output", "val_data", "steps_per_eval", "val_batches", "save_every", "resume",
                "skip_bad_records", "revision", "trust_remote_code", "grad_checkpoint"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
