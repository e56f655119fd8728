"""Every setting of a fine-tuning run (the CLI's flags), and the ones a resume must keep."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mlxvlm.errors import MlxvlmError
from mlxvlm.sampling.ranges import POSITIVE, Range, at_least

LR_SCHEDULES = ("constant", "cosine", "linear")
# Without --learning-rate: the usual starting points for adapters and for full weights.
DEFAULT_LEARNING_RATE = {"lora": 1e-4, "dora": 1e-4, "full": 1e-5}

# The valid values of the numeric settings (the CLI's flag types and __post_init__).
RANGES = {
    "rank": at_least(1),
    "alpha": POSITIVE,
    "dropout": Range(float, 0, 1, high_open=True),
    "num_layers": Range(int, 0, 2**31 - 1, also=(-1,)),  # -1: all; 0 with --train-vision: the tower alone
    "batch_size": at_least(1),
    "grad_accumulation_steps": at_least(1),
    "iters": at_least(1),
    "epochs": POSITIVE,
    "learning_rate": POSITIVE,
    "warmup_steps": at_least(0),
    "max_seq_length": at_least(2),
    "steps_per_eval": at_least(1),
    "val_batches": Range(int, 1, 2**31 - 1, also=(-1,)),  # -1: the whole validation set
    "save_every": at_least(1),
    # numpy's generators take non-negative seeds, MLX's unsigned 64-bit ones.
    "seed": Range(int, 0, 2**63 - 1),
}


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
        bad = [
            "--" + name.replace("_", "-")
            for name, valid in RANGES.items()
            if getattr(self, name) is not None and not _within(valid, getattr(self, name))
        ]
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


def _within(valid: Range, value) -> bool:
    # An int is fine where a float is meant (epochs=1 from Python code).
    if valid.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return valid.problem(value) is None
