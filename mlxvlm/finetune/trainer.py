"""The training loop: token-weighted loss over assistant tokens, gradient accumulation,
validation, progress and checkpoints.

Each sequence of a batch goes through the model on its own, at its own length and with
its own images (of any size and number): ``embed`` runs the vision tower and places the
image tokens, the decoder gets that sequence's position state, and nothing is padded.
The gradients of a batch (and of ``grad_accumulation_steps`` batches) are summed and
divided by their number of assistant tokens, so a step minimises the mean loss per
assistant token over everything it saw -- the same as one padded batch with a mask.

One step is one optimizer update. Step ``s`` always trains on micro-batches
``[s * G, (s + 1) * G)`` of the ``BatchOrder`` and seeds MLX's random state (dropout)
from (seed, s), so a resumed run repeats exactly what an uninterrupted one does.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map
from mlx_lm.tuner.trainer import grad_checkpoint
from mlx_lm.tuner.utils import build_schedule

from mlxvlm.finetune.dataset import BatchOrder, ExampleSet, evaluation_batches
from mlxvlm.finetune.masking import EncodedConversation
from mlxvlm.models.feature_cache import no_feature_cache


def model_inputs(model: nn.Module, encoded: EncodedConversation):
    """(input_ids (1, L), loss mask (L,), features) as the model takes them."""
    names = getattr(model, "feature_names", ())
    features = {k: mx.array(v) for k, v in encoded.features.items() if k in names}
    input_ids = mx.array(encoded.input_ids, dtype=mx.int32)[None]
    return input_ids, mx.array(encoded.loss_mask, dtype=mx.float32), features


def sequence_loss(model: nn.Module, input_ids: mx.array, loss_mask: mx.array,
                  features: dict) -> mx.array:
    """Summed cross-entropy of the assistant tokens of one sequence. The towers run on
    every image (never the inference feature cache): the loss needs their gradients."""
    with no_feature_cache():
        embeddings, state = model.embed(input_ids, **features)
    logits = model(input_ids[:, :-1], embeddings=embeddings[:, :-1], state=state)
    losses = nn.losses.cross_entropy(logits.astype(mx.float32), input_ids[:, 1:])
    return (losses * loss_mask[None, 1:]).sum()


def peak_memory_gb() -> float:
    """MLX's peak allocation on a GPU; on the CPU backend, which does not count its
    allocations, the process's peak resident size."""
    if mx.default_device() != mx.cpu:
        return mx.get_peak_memory() / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss if sys.platform == "darwin" else rss * 1024) / 1e9  # bytes on macOS, KiB on Linux


def learning_rate_schedule(learning_rate: float, schedule: str, total_steps: int,
                           warmup_steps: int):
    """mlx-lm's schedules: a linear warmup from 0, then constant, cosine or linear decay."""
    decay_steps = max(total_steps - warmup_steps, 1)
    if schedule == "cosine":
        config = {"name": "cosine_decay", "arguments": [learning_rate, decay_steps]}
    elif schedule == "linear":
        config = {"name": "linear_schedule", "arguments": [learning_rate, 0.0, decay_steps]}
    elif warmup_steps:
        config = {"name": "linear_schedule", "arguments": [learning_rate, learning_rate, 1]}
    else:
        return learning_rate
    return build_schedule({**config, "warmup": warmup_steps})


def total_steps(num_examples: int, batch_size: int, grad_accumulation_steps: int,
                iters: int | None, epochs: float | None) -> int:
    if iters is not None:
        return iters
    batches = math.ceil(num_examples / batch_size) * (1.0 if epochs is None else epochs)
    return max(1, math.ceil(batches / grad_accumulation_steps))


@dataclass
class LoopSettings:
    total_steps: int
    batch_size: int
    grad_accumulation_steps: int = 1
    steps_per_eval: int = 200
    val_batches: int = 25
    save_every: int = 100
    seed: int = 0
    grad_checkpoint: bool = False


@dataclass
class StepReport:
    step: int
    loss: float
    learning_rate: float
    tokens: int  # every token the step processed (prompt, images, answers)
    loss_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: optim.Optimizer,
        train_set: ExampleSet,
        settings: LoopSettings,
        *,
        val_set: ExampleSet | None = None,
        save: Callable[[int, dict], Any] | None = None,
        callback: Any = None,
        progress: Any = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.train_set = train_set
        self.val_set = val_set
        self.settings = settings
        self.save = save
        self.callback = callback  # an mlx_lm.tuner.callbacks.TrainingCallback
        self.progress = progress  # tqdm-like: update(), set_postfix(), write()
        self.order = BatchOrder(len(train_set), settings.batch_size, settings.seed)
        self.loss_and_grad = nn.value_and_grad(model, sequence_loss)
        self.last_val_loss: float | None = None

    # -- one step ------------------------------------------------------------------

    def step(self, step: int) -> StepReport:
        tic = time.perf_counter()
        self.model.train()
        mx.random.seed(self.settings.seed * 1_000_003 + step)
        accumulation = self.settings.grad_accumulation_steps
        grads, loss_sum, tokens, loss_tokens = None, 0.0, 0, 0
        for micro in range(step * accumulation, (step + 1) * accumulation):
            for index in self.order.batch(micro):
                encoded = self.train_set.encode(index)
                loss, g = self.loss_and_grad(self.model, *model_inputs(self.model, encoded))
                grads = g if grads is None else tree_map(mx.add, grads, g)
                # Evaluate now: the sequence's graph and activations are freed before the next.
                mx.eval(loss, grads)
                loss_sum += loss.item()
                tokens += encoded.num_tokens
                loss_tokens += encoded.num_loss_tokens
        grads = tree_map(lambda g: g / loss_tokens, grads)
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.trainable_parameters(), self.optimizer.state)
        return StepReport(
            step=step + 1,
            loss=loss_sum / loss_tokens,
            learning_rate=float(self.optimizer.learning_rate),
            tokens=tokens,
            loss_tokens=loss_tokens,
            seconds=time.perf_counter() - tic,
        )

    def evaluate(self) -> float:
        """Mean loss per assistant token over the first ``val_batches`` batches."""
        self.model.eval()
        loss_sum, loss_tokens = 0.0, 0
        batches = evaluation_batches(len(self.val_set), self.settings.batch_size,
                                     self.settings.val_batches)
        for batch in batches:
            for index in batch:
                encoded = self.val_set.encode(index)
                loss = sequence_loss(self.model, *model_inputs(self.model, encoded))
                loss_sum += loss.item()
                loss_tokens += encoded.num_loss_tokens
        return loss_sum / max(loss_tokens, 1)

    # -- the loop ------------------------------------------------------------------

    def run(self, start_step: int = 0) -> StepReport | None:
        if not self.settings.grad_checkpoint:
            return self._run(start_step)
        # mlx-lm's grad_checkpoint patches the decoder block's class; undo it afterwards
        # so that later inference in this process is not recomputing anything.
        block_class = type(self.model.layers[0])
        original = block_class.__call__
        grad_checkpoint(self.model.layers[0])
        try:
            return self._run(start_step)
        finally:
            block_class.__call__ = original

    def _run(self, start_step: int) -> StepReport | None:
        settings = self.settings
        report = None
        trained_tokens = 0
        for step in range(start_step, settings.total_steps):
            if step % settings.steps_per_eval == 0 and (step > start_step or step == 0):
                self._validate(step)
            report = self.step(step)
            trained_tokens += report.tokens
            self._report(report, trained_tokens)
            done = report.step
            if done % settings.save_every == 0 and done < settings.total_steps and self.save:
                path = self.save(done, self._metrics(report))
                self._write(f"step {done}: saved checkpoint {path}")
        if self.val_set is not None and settings.total_steps > start_step:
            self._validate(settings.total_steps)
        return report

    def _metrics(self, report: StepReport) -> dict:
        return {"train_loss": report.loss, "val_loss": self.last_val_loss}

    def _validate(self, step: int) -> None:
        if self.val_set is None:
            return
        tic = time.perf_counter()
        self.last_val_loss = self.evaluate()
        seconds = time.perf_counter() - tic
        self._write(f"step {step}: val loss {self.last_val_loss:.4f} ({seconds:.1f}s)")
        if self.callback is not None:
            self.callback.on_val_loss_report(
                {"iteration": step, "val_loss": self.last_val_loss, "val_time": seconds}
            )

    def _report(self, report: StepReport, trained_tokens: int) -> None:
        peak_gb = peak_memory_gb()
        if self.progress is not None:
            self.progress.set_postfix(
                loss=f"{report.loss:.3f}", lr=f"{report.learning_rate:.2e}",
                tok_s=f"{report.tokens_per_second:.0f}", mem=f"{peak_gb:.2f}GB",
                refresh=False,
            )
            self.progress.update(1)
        if self.callback is not None:
            self.callback.on_train_loss_report({
                "iteration": report.step,
                "train_loss": report.loss,
                "learning_rate": report.learning_rate,
                "iterations_per_second": 1 / max(report.seconds, 1e-9),
                "tokens_per_second": report.tokens_per_second,
                "trained_tokens": trained_tokens,
                "peak_memory": peak_gb,
            })

    def _write(self, line: str) -> None:
        if self.progress is not None:
            self.progress.write(line)
