"""One fine-tuning run, end to end: load, make trainable, check the data, train (or resume),
save.

What ``--output`` holds at the end:

- lora / dora: the adapter in PEFT's format (``adapter_config.json``,
  ``adapter_model.safetensors``), for ``--adapter-path``, ``python -m mlxvlm.fuse`` or
  ``peft.PeftModel.from_pretrained``;
- full: a whole model checkpoint in MLX layout (as ``python -m mlxvlm.convert`` writes);

plus ``training_config.json`` (the settings) and ``checkpoints/`` (see checkpoints.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from mlxvlm.checkpoint.adapters import load_adapter_weights, save_adapter
from mlxvlm.errors import MlxvlmError
from mlxvlm.finetune import checkpoints
from mlxvlm.finetune.config import FinetuneConfig
from mlxvlm.finetune.data import default_validation, open_records
from mlxvlm.finetune.dataset import ExampleSet, prepare_examples
from mlxvlm.progress import progress, say
from mlxvlm.finetune.trainer import LoopSettings, Trainer, learning_rate_schedule, total_steps
from mlxvlm.finetune.tuning import apply_tuning
from mlxvlm.retrieval.api import check_generates

CONFIG_FILE = "training_config.json"
FULL_WEIGHTS_FILE = "model.safetensors"  # a full fine-tune's trained tensors, in a checkpoint


@dataclass
class FinetuneResult:
    output: Path
    steps: int
    train_loss: float | None
    val_loss: float | None
    train_examples: int
    skipped_records: int
    tuning: Any = None  # tuning.TuningSummary: what was trained


def _prepare(records, processor, config: FinetuneConfig, what: str) -> ExampleSet:
    with progress(total=len(records), desc=f"Checking {what} records", unit="record",
                  leave=False) as bar:
        def tick(indices):
            for index in indices:
                yield index
                bar.update(1)

        examples = prepare_examples(
            records, processor, max_seq_length=config.max_seq_length,
            skip_bad_records=config.skip_bad_records, progress=tick,
        )
    for bad in examples.skipped[:20]:
        say(f"skipped {bad}")
    if len(examples.skipped) > 20:
        say(f"skipped {len(examples.skipped) - 20} more bad records")
    return examples


class _Weights:
    """Writes and reads what a run trains: the adapter, or a full fine-tune's tensors."""

    def __init__(self, model, config: FinetuneConfig):
        self.model = model
        self.config = config

    def write(self, folder: Path) -> None:
        if self.config.method == "full":
            trained = dict(tree_flatten(self.model.trainable_parameters()))
            mx.save_safetensors(str(folder / FULL_WEIGHTS_FILE), trained)
        else:
            save_adapter(self.model, folder, alpha=self.config.alpha,
                         dropout=self.config.dropout, base_model=self.config.model)

    def read(self, folder: Path) -> None:
        if self.config.method == "full":
            trained = mx.load(str(folder / FULL_WEIGHTS_FILE))
            self.model.load_weights(list(trained.items()), strict=False)
            mx.eval(self.model.parameters())
        else:
            load_adapter_weights(self.model, folder)


def _resume(output: Path, trajectory: dict, weights: _Weights, optimizer) -> int:
    """Load the newest checkpoint; returns its step (0 when there is none)."""
    found = checkpoints.list_checkpoints(output)
    if not found:
        say(f"no checkpoint in {checkpoints.checkpoints_dir(output)}; starting from step 0")
        return 0
    folder = found[-1]
    state, optimizer_state = checkpoints.read_checkpoint(folder)
    saved = state.get("trajectory", {})
    changed = sorted(k for k in set(saved) | set(trajectory) if saved.get(k) != trajectory.get(k))
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {trajectory.get(k)!r}" for k in changed[:4])
        raise MlxvlmError(
            f"cannot resume from {folder}: the run's settings changed ({details}); resume "
            "with the same settings, or start anew in another --output"
        )
    weights.read(folder)
    optimizer.state = optimizer_state
    mx.eval(optimizer.state)
    say(f"resumed from {folder} (step {state['step']})")
    return int(state["step"])


def _keep_quantized_for_training(model) -> None:
    """A quantized base stays quantized under LoRA (QLoRA: the memory of the quantized
    weights). MLX's CPU kernels for quantized products are slow for the many rows of a
    training sequence, so there each quantized layer is wrapped to dequantize on the fly
    and use BLAS (mlxvlm.cpu.fast_paths), still holding only the quantized weights."""
    from mlxvlm.cpu import ops

    ops.stream_quantized_layers(model)


def _write_full_model(model, model_path: Path, output: Path) -> None:
    """The fine-tuned model as an MLX checkpoint in ``output`` (its own files replaced one by
    one, each atomically; ``checkpoints/`` stays)."""
    from mlxvlm.convert import staged_checkpoint
    from mlxvlm.checkpoint.loading import read_config

    config = read_config(model_path)
    source_dtype = config.get("torch_dtype") or config.get("dtype")
    if source_dtype in ("float16", "bfloat16"):
        model.set_dtype(getattr(mx, source_dtype))
    staging = output / f".model.partial-{os.getpid()}"
    with staged_checkpoint(model, config, model_path, staging):
        for old in list(output.glob("*.safetensors")) + list(output.glob("*.safetensors.index.json")):
            old.unlink()
        for file in staging.iterdir():
            os.replace(file, output / file.name)


def finetune(config: FinetuneConfig, *, callback: Any = None) -> FinetuneResult:
    """Run ``config``; ``callback`` is an ``mlx_lm.tuner.callbacks.TrainingCallback``
    (its ``on_train_loss_report`` / ``on_val_loss_report`` get each step's figures)."""
    from mlxvlm.checkpoint.loading import load, resolve_model_path

    output = Path(config.output).expanduser()
    if not config.resume and checkpoints.list_checkpoints(output):
        raise MlxvlmError(
            f"{output} holds checkpoints of an earlier run: pass --resume to continue it, "
            "or choose another --output"
        )
    # The data is opened (not yet checked) first: a wrong path fails before the model loads.
    train_records = open_records(config.data, split="train")
    val_records = (
        open_records(config.val_data, split="validation", flag="--val-data") if config.val_data
        else default_validation(config.data)
    )
    model_path = resolve_model_path(config.model, config.revision, config.trust_remote_code)
    # The whole model in memory: a full fine-tune trains and saves every table.
    model, processor = load(model_path, cpu_fast_paths=False, tables_on_disk=False)
    check_generates(model)  # a retrieval model's loss would be a language model's
    _keep_quantized_for_training(model)
    mx.random.seed(config.seed)  # the adapters' initial weights
    summary = apply_tuning(
        model, config.method, rank=config.rank, alpha=config.alpha, dropout=config.dropout,
        target_modules=config.target_modules, num_layers=config.num_layers,
        train_vision=config.train_vision,
    )
    say(summary.describe())

    train_set = _prepare(train_records, processor, config, "training")
    val_set = _prepare(val_records, processor, config, "validation") if val_records else None

    steps = total_steps(len(train_set), config.batch_size, config.grad_accumulation_steps,
                        config.iters, config.epochs)
    trajectory = {**config.trajectory(), "train_examples": len(train_set), "total_steps": steps}
    optimizer = optim.Adam(learning_rate=learning_rate_schedule(
        config.learning_rate, config.lr_schedule, steps, config.warmup_steps))
    optimizer.init(model.trainable_parameters())

    weights = _Weights(model, config)
    output.mkdir(parents=True, exist_ok=True)
    checkpoints.remove_staging(output)
    start = _resume(output, trajectory, weights, optimizer) if config.resume else 0
    (output / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(config), indent=2))

    def save(step: int, metrics: dict) -> Path:
        return checkpoints.write_checkpoint(
            output, step, write_weights=weights.write, optimizer_state=optimizer.state,
            state={"trajectory": trajectory, **metrics},
        )

    settings = LoopSettings(
        total_steps=steps, batch_size=config.batch_size,
        grad_accumulation_steps=config.grad_accumulation_steps,
        steps_per_eval=config.steps_per_eval, val_batches=config.val_batches,
        save_every=config.save_every, seed=config.seed, grad_checkpoint=config.grad_checkpoint,
    )
    say(f"training on {len(train_set)} examples ({train_set.num_tokens:,} tokens) for "
         f"{steps} steps of {config.batch_size} x {config.grad_accumulation_steps}")
    with progress(total=steps, initial=start, desc="Training", unit="step") as bar:
        trainer = Trainer(model, optimizer, train_set, settings, val_set=val_set, save=save,
                          callback=callback, progress=bar)
        report = trainer.run(start)

    if config.method == "full":
        _write_full_model(model, model_path, output)
    else:
        weights.write(output)
    say(f"saved the {'model' if config.method == 'full' else 'adapter'} to {output}")
    return FinetuneResult(
        output=output,
        steps=steps,
        train_loss=report.loss if report else None,
        val_loss=trainer.last_val_loss,
        train_examples=len(train_set),
        skipped_records=len(train_set.skipped),
        tuning=summary,
    )
