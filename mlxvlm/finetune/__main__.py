"""`python -m mlxvlm.finetune`: fine-tune a vision-language model on conversations with
images. Flags follow mlx-lm's ``mlx_lm.lora`` where they exist."""

from __future__ import annotations

import argparse
from typing import Sequence

from mlxvlm.cli import OneLineParser, ranged
from mlxvlm.finetune.config import LR_SCHEDULES, RANGES, FinetuneConfig
from mlxvlm.finetune.tuning import METHODS


def _in(name: str):
    """The argparse type of the flag for ``FinetuneConfig.<name>``: its range in RANGES."""
    return ranged(RANGES[name])


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m mlxvlm.finetune",
        description="Fine-tune a vision-language model (LoRA, DoRA, QLoRA or full) on "
        "conversations with images; adapters are saved in PEFT's format.",
    )
    add = parser.add_argument
    add("--model", required=True, help="Local checkpoint directory or Hugging Face repo id")
    add("--revision", default=None, help="Hub revision of --model (default: main)")
    add("--trust-remote-code", action="store_true", help="Also download the repo's *.py files")
    add("--data", required=True,
        help="JSONL file; folder with train.jsonl (and valid.jsonl); dataset saved with "
        "datasets' save_to_disk; or Hub dataset id NAME[:SPLIT]")
    add("--val-data", default=None, help="Validation data, in any --data form "
        "(default: valid.jsonl beside train.jsonl)")
    add("--skip-bad-records", action="store_true",
        help="Train without the records that cannot be used, instead of stopping")
    add("--output", "--adapter-path", dest="output", default="adapters",
        help="Folder for the adapter (or the full model) and its checkpoints")

    method = parser.add_argument_group("what is trained")
    method.add_argument("--method", "--fine-tune-type", dest="method", choices=METHODS,
                        default="lora", help="lora (QLoRA on a quantized model), dora or full")
    method.add_argument("--rank", type=_in("rank"), default=8, help="LoRA rank r")
    method.add_argument("--alpha", type=_in("alpha"), default=16.0,
                        help="LoRA alpha (the update is scaled by alpha / rank)")
    method.add_argument("--dropout", type=_in("dropout"), default=0.0,
                        help="LoRA dropout, in [0, 1)")
    method.add_argument("--target-modules", nargs="+", default=None,
                        help="Names of the linear layers to adapt, e.g. q_proj v_proj "
                        "(default: every linear layer of the tuned blocks)")
    method.add_argument("--num-layers", type=_in("num_layers"), default=-1,
                        help="Tune the last N decoder blocks (-1: all)")
    method.add_argument("--train-vision", action="store_true",
                        help="Also tune the vision tower and projector")

    loop = parser.add_argument_group("training loop")
    loop.add_argument("--batch-size", type=_in("batch_size"), default=4,
                      help="Examples per batch")
    loop.add_argument("--grad-accumulation-steps", type=_in("grad_accumulation_steps"),
                      default=1, help="Batches whose gradients make one optimizer step")
    length = loop.add_mutually_exclusive_group()
    length.add_argument("--iters", type=_in("iters"), default=None,
                        help="Optimizer steps (default: one epoch)")
    length.add_argument("--epochs", type=_in("epochs"), default=None,
                        help="Passes over the data (default: 1 unless --iters)")
    # --lr: many training scripts' name; without it argparse reads it as --lr-schedule.
    loop.add_argument("--learning-rate", "--lr", type=_in("learning_rate"), default=None,
                      help="Peak learning rate (default: 1e-4 for lora/dora, 1e-5 for full)")
    loop.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                      help="How the learning rate changes after the warmup")
    loop.add_argument("--warmup-steps", type=_in("warmup_steps"), default=0,
                      help="Steps of linear warmup from 0")
    loop.add_argument("--max-seq-length", type=_in("max_seq_length"), default=2048,
                      help="Longest example in tokens (image tokens included); longer "
                      "ones are bad records")
    loop.add_argument("--grad-checkpoint", action="store_true",
                      help="Recompute activations in the backward pass to save memory")
    loop.add_argument("--seed", type=_in("seed"), default=0,
                      help="Seed of the adapters' initial weights, dropout and data order")

    progress = parser.add_argument_group("validation and checkpoints")
    progress.add_argument("--steps-per-eval", type=_in("steps_per_eval"), default=200,
                          help="Optimizer steps between validations")
    progress.add_argument("--val-batches", type=_in("val_batches"), default=25,
                          help="Validation batches per evaluation (-1: all)")
    progress.add_argument("--save-every", type=_in("save_every"), default=100,
                          help="Write a checkpoint every N steps")
    progress.add_argument("--resume", action="store_true",
                          help="Continue from the newest checkpoint in --output")
    return parser


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    fields = FinetuneConfig.__dataclass_fields__
    return FinetuneConfig(**{k: v for k, v in vars(args).items() if k in fields})


def main(argv: Sequence[str] | None = None) -> int:
    from mlxvlm.cli import run_cli

    args = build_parser().parse_args(argv)

    def body() -> int:
        from mlxvlm.finetune.run import finetune

        result = finetune(config_from_args(args))
        losses = [f"train loss {result.train_loss:.4f}" if result.train_loss is not None else "",
                  f"val loss {result.val_loss:.4f}" if result.val_loss is not None else ""]
        summary = ", ".join(x for x in losses if x)
        print(f"done: {result.steps} steps{', ' + summary if summary else ''}; {result.output}")
        return 0

    return run_cli(body)


if __name__ == "__main__":
    raise SystemExit(main())
