"""`python -m mlxvlm.fuse`: merge a LoRA/DoRA adapter into its base model.

    python -m mlxvlm.fuse --model Qwen/Qwen2-VL-2B-Instruct --adapter-path adapters \\
        --mlx-path qwen2-vl-shapes -q

Each adapted layer is replaced by one linear layer holding ``W + scale * B @ A`` (DoRA:
rescaled to the learned magnitudes), with mlx-lm's ``fuse``. On a quantized base the fused
layers are quantized again with the base's settings, unless ``-d`` dequantizes the whole
model or ``-q`` re-quantizes it with new ones. The result is written through
``mlxvlm.convert``, so it is the same kind of checkpoint (MLX layout, the base's dtype
unless ``--dtype``, model card, tokenizer and processor files).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mlxvlm.errors import MlxvlmError


@dataclass
class FuseResult:
    converted: Any  # mlxvlm.convert.ConvertResult: where, how big, how quantized
    fused_layers: int


def build_parser() -> argparse.ArgumentParser:
    from mlxvlm.convert import DTYPES
    from mlxvlm.checkpoint.quantization import MODE_DEFAULTS, RECIPES

    from mlxvlm.cli import OneLineParser, ranged
    from mlxvlm.sampling.ranges import at_least

    parser = OneLineParser(
        prog="python -m mlxvlm.fuse",
        description="Merge a LoRA/DoRA adapter (PEFT format) into its base model.",
    )
    add = parser.add_argument
    add("--model", required=True, help="Base model: local checkpoint directory or Hub repo id")
    add("--adapter-path", required=True, help="The adapter's folder (adapter_config.json ...)")
    add("--mlx-path", default="fused_model", help="Output directory")
    add("--revision", default=None, help="Hub revision of the base model (default: main)")
    add("--trust-remote-code", action="store_true", help="Also download the repo's *.py files")
    add("-q", "--quantize", action="store_true", help="Quantize the fused model")
    # The mode decides which bits and group sizes are possible (checked by quant_spec).
    add("--q-bits", type=ranged(at_least(1, 16)), default=None,
        help="Bits per weight (default 4)")
    add("--q-group-size", type=ranged(at_least(1, 4096)), default=None,
        help="Weights per scale (default 64)")
    add("--q-mode", default=None,
        help=f"Quantization mode: {', '.join(MODE_DEFAULTS)} (default: affine)")
    add("--quant-predicate", default=None,
        help=f"Mixed-precision recipe: {', '.join(RECIPES)} (default: none)")
    add("--quantize-vision", action="store_true", help="Also quantize the vision tower")
    add("-d", "--dequantize", action="store_true",
        help="Write a float model even if the base is quantized")
    add("--dtype", default=None, help=f"Float dtype: {', '.join(DTYPES)} (default: the base's)")
    add("--upload-repo", default=None,
        help="Hugging Face repo to upload the result to (default: no upload)")
    add("--force", action="store_true", help="Replace --mlx-path if it holds a checkpoint")
    return parser


def fuse_adapter_layers(model, dequantize: bool = False) -> int:
    """Replace every LoRA/DoRA layer by its fused linear layer; returns how many."""
    from mlx.utils import tree_unflatten

    from mlxvlm.checkpoint.adapters import adapter_layers

    fused = [(name, layer.fuse(dequantize=dequantize)) for name, layer in adapter_layers(model)]
    model.update_modules(tree_unflatten(fused))
    return len(fused)


def fuse(
    model: str,
    adapter_path: str | Path,
    mlx_path: str | Path = "fused_model",
    *,
    quantize: bool = False,
    dequantize: bool = False,
    revision: str | None = None,
    trust_remote_code: bool = False,
    **convert_options,
) -> FuseResult:
    """Fuse ``adapter_path`` into ``model`` and write it to ``mlx_path``; the other keyword
    arguments are ``mlxvlm.convert.convert``'s (q_bits, dtype, force ...)."""
    from mlx_lm.utils import dequantize_model

    from mlxvlm.checkpoint.adapters import load_adapter
    from mlxvlm.convert import convert, staged_checkpoint
    from mlxvlm.checkpoint.loading import load_model, read_config, resolve_model_path
    from mlxvlm.checkpoint.quantization import read_quantization

    if quantize and dequantize:
        raise MlxvlmError("choose either -q/--quantize or -d/--dequantize, not both")
    mlx_path = Path(mlx_path).expanduser()
    if (mlx_path.exists() or mlx_path.is_symlink()) and not convert_options.get("force"):
        raise MlxvlmError(f"{mlx_path} already exists; choose another --mlx-path or pass --force")
    source = resolve_model_path(model, revision, trust_remote_code)
    config = read_config(source)
    quantized_base = read_quantization(config) is not None
    # Weights in float32 while fusing; convert casts them back to the base's dtype.
    base = load_model(source, config)
    load_adapter(base, adapter_path)
    count = fuse_adapter_layers(base, dequantize=quantize or dequantize)
    if quantized_base and quantize:  # re-quantized below with the new settings
        base = dequantize_model(base)
        config.pop("quantization", None)
        config.pop("quantization_config", None)

    staging = mlx_path.parent / f".{mlx_path.name}.fusing-{os.getpid()}"
    with staged_checkpoint(base, config, source, staging):
        result = convert(
            str(staging), mlx_path, quantize=quantize,
            dequantize=dequantize and quantized_base, **convert_options,
        )
    return FuseResult(result, count)


def main(argv: Sequence[str] | None = None) -> int:
    from mlxvlm.cli import run_cli

    args = build_parser().parse_args(argv)

    def body() -> int:
        result = fuse(
            args.model, args.adapter_path, args.mlx_path, quantize=args.quantize,
            dequantize=args.dequantize, revision=args.revision,
            trust_remote_code=args.trust_remote_code, q_bits=args.q_bits,
            q_group_size=args.q_group_size, q_mode=args.q_mode,
            quant_predicate=args.quant_predicate, quantize_vision=args.quantize_vision,
            dtype=args.dtype, upload_repo=args.upload_repo, force=args.force,
        )
        print(f"Fused {result.fused_layers} adapted layers. {result.converted.report()}")
        return 0

    return run_cli(body)


if __name__ == "__main__":
    raise SystemExit(main())
