"""`python -m mlxvlm.convert`: a Hugging Face (or MLX) checkpoint -> an MLX checkpoint.

The output is what mlx-community publishes: safetensors shards (at most 5 GB each) with an
index, ``config.json`` with the vision/audio configs kept and mlx-lm's ``quantization``
layout, the tokenizer/processor/chat-template files, and a model card. It is marked as
converted (``loading.CONVERTED_MARKER``), so ``load`` never runs a family's ``sanitize``
on it again. Weights can be cast (``--dtype``), quantized (``-q``, uniform or a mixed
recipe), dequantized (``-d``), and the result uploaded to the Hub.

    python -m mlxvlm.convert --hf-path Qwen/Qwen2-VL-2B-Instruct --mlx-path qwen2-vl-4bit -q
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from mlxvlm.errors import MlxvlmError

DTYPES = ("float16", "bfloat16", "float32")
MAX_SHARD_GB = 5
CONVERTED_FORMAT_VERSION = 1

# Top-level files of the source that are not weights or the config: tokenizer,
# processor, chat template, generation config (and remote code, when downloaded).
# spk_dict.pt: Qwen2.5-Omni's voices (mlxvlm/speech/spk_dict.py reads it without torch)
SIDE_FILE_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "tokenizer*", "*.py",
                      "spk_dict.pt")
NOT_SIDE_FILES = {"config.json", "model.safetensors.index.json", "adapter_config.json"}


@dataclass
class ConvertResult:
    path: Path
    shards: list[str]
    size_bytes: int  # of the weight files
    bits_per_weight: float
    # The language model alone (the float towers weigh on the figure above).
    text_bits_per_weight: float | None
    quantization: dict | None
    # Modules the quantization selected but left float: their shapes do not divide by
    # the group size.
    unquantized: list[str] = field(default_factory=list)

    def report(self) -> str:
        how = _describe_precision(self.quantization, None) if self.quantization else "not quantized"
        shards = f"{len(self.shards)} shard{'s' if len(self.shards) > 1 else ''}"
        return (
            f"Saved {self.path} ({shards}, {_human_size(self.size_bytes)} on disk): "
            f"{how}, {self.bits_per_weight:.2f} bits per weight"
            + (f" (language model: {self.text_bits_per_weight:.2f})"
               if self.text_bits_per_weight is not None else "")
        )


def build_parser() -> argparse.ArgumentParser:
    from mlxvlm.cli import OneLineParser, ranged
    from mlxvlm.sampling.ranges import at_least
    from mlxvlm.checkpoint.quantization import AFFINE_GROUP_SIZES, MODE_DEFAULTS, RECIPES

    parser = OneLineParser(
        prog="python -m mlxvlm.convert",
        description="Convert a Hugging Face vision-language model to MLX, optionally quantized.",
    )
    parser.add_argument("--hf-path", "--model", required=True,
                        help="Source: local checkpoint directory or Hugging Face repo id")
    parser.add_argument("--mlx-path", default="mlx_model", help="Output directory")
    parser.add_argument("--revision", default=None,
                        help="Hub revision of the source (default: main)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="Also download (and copy) the source repo's *.py files")
    parser.add_argument("-q", "--quantize", action="store_true", help="Quantize the weights")
    # The mode decides which bits and group sizes are possible (checked by quant_spec).
    parser.add_argument("--q-bits", type=ranged(at_least(1, 16)), default=None,
                        help="Bits per weight (affine: 2, 3, 4, 5, 6, 8; default 4)")
    parser.add_argument("--q-group-size", type=ranged(at_least(1, 4096)), default=None,
                        help=f"Weights per scale (affine: {', '.join(map(str, AFFINE_GROUP_SIZES))};"
                             " default 64)")
    parser.add_argument("--q-mode", default=None,
                        help=f"Quantization mode: {', '.join(MODE_DEFAULTS)} (default affine)")
    parser.add_argument("--quant-predicate", default=None,
                        help=f"Mixed-precision recipe: {', '.join(RECIPES)} (default: none, "
                        "every layer alike)")
    parser.add_argument("--quantize-vision", action="store_true",
                        help="Also quantize the vision/audio towers and projectors")
    parser.add_argument("-d", "--dequantize", action="store_true",
                        help="Dequantize a quantized checkpoint")
    parser.add_argument("--dtype", default=None,
                        help=f"Float dtype of the weights: {', '.join(DTYPES)} "
                             "(default: the checkpoint's)")
    parser.add_argument("--upload-repo", default=None,
                        help="Hugging Face repo to upload to (default: no upload)")
    parser.add_argument("--force", action="store_true",
                        help="Replace the output directory if it exists")
    parser.add_argument("--verbose", action="store_true",
                        help="Also list the modules left unquantized")
    return parser


# ------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class _Plan:
    """What to do to the weights, validated before anything is read."""

    spec: object | None  # QuantSpec: the default (low) settings when quantizing
    recipe: tuple | None  # (low, high) QuantSpecs of a mixed recipe
    dtype: str | None


def _plan(args: argparse.Namespace) -> _Plan:
    from mlxvlm.checkpoint.quantization import QuantizationError, quant_spec, recipe_spec

    if args.dtype is not None and args.dtype not in DTYPES:
        raise MlxvlmError(f"unknown --dtype {args.dtype!r} (choose from {', '.join(DTYPES)})")
    quant_flags = [
        flag for flag, value in (
            ("--q-bits", args.q_bits), ("--q-group-size", args.q_group_size),
            ("--q-mode", args.q_mode), ("--quant-predicate", args.quant_predicate),
            ("--quantize-vision", args.quantize_vision or None),
        ) if value is not None
    ]
    if args.quantize and args.dequantize:
        raise MlxvlmError("choose either -q/--quantize or -d/--dequantize, not both")
    if quant_flags and not args.quantize:
        raise MlxvlmError(f"{', '.join(quant_flags)} only apply with -q/--quantize")
    if not args.quantize:
        return _Plan(None, None, args.dtype)
    if args.quant_predicate is None:
        return _Plan(quant_spec(args.q_mode, args.q_bits, args.q_group_size), None, args.dtype)
    if args.q_mode not in (None, "affine"):
        raise QuantizationError("mixed recipes use affine quantization; drop --q-mode")
    if args.q_bits is not None:
        raise QuantizationError(f"{args.quant_predicate} sets the bits itself; drop --q-bits")
    low, high = recipe_spec(args.quant_predicate, args.q_group_size)
    return _Plan(low, (low, high), args.dtype)


def _check_destination(mlx_path: Path, force: bool) -> None:
    if not (mlx_path.exists() or mlx_path.is_symlink()):
        return
    if not force:
        raise MlxvlmError(f"{mlx_path} already exists; choose another --mlx-path or pass --force")
    # --force replaces a previous conversion, never an arbitrary directory.
    if mlx_path.is_dir() and any(mlx_path.iterdir()) and not (mlx_path / "config.json").exists():
        raise MlxvlmError(
            f"{mlx_path} exists and is not a model checkpoint; refusing to replace it "
            "even with --force"
        )


# ------------------------------------------------------------------------------ reading


def _read_model(model_path: Path, config: dict, family, head_optional: bool = False):
    """The family's module tree with the source weights (lazily loaded, any quantization
    of the source applied), in the source's names mapped onto ours; ``head_optional``:
    see ``build_model``."""
    import mlx.core as mx
    from tqdm import tqdm

    from mlxvlm.checkpoint.loading import build_model, weights_files

    weights: dict[str, mx.array] = {}
    for file in tqdm(weights_files(model_path), desc="Reading weights", unit="file", disable=None):
        weights.update(mx.load(str(file)))
    return build_model(model_path, config, family, weights, head_optional=head_optional)


def _source_dtype(config: dict) -> str | None:
    for value in (config.get("torch_dtype"), config.get("dtype"),
                  (config.get("text_config") or {}).get("dtype")):
        if value in DTYPES:
            return value
    return None


def _cast_floats(model, dtype_name: str) -> None:
    """Floating parameters to ``dtype_name``; a family may keep some in float32 through
    a ``cast_predicate(path)`` (as mlx-lm's models do)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    dtype = getattr(mx, dtype_name)
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path, value):
        if keep(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))


# ------------------------------------------------------------------------------ writing


def write_weights(model, directory: Path) -> list[str]:
    """Shards of at most 5 GB plus ``model.safetensors.index.json``, as mlx-lm writes
    them, with a progress bar; each tensor is computed (read, cast, quantized) as it is
    written. The model's parameters are released along the way."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import get_total_parameters, make_shards
    from tqdm import tqdm

    weights = dict(tree_flatten(model.parameters()))
    total_size = sum(v.nbytes for v in weights.values())
    total_parameters = get_total_parameters(model)
    shards = make_shards(weights, MAX_SHARD_GB)
    names = (
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        if len(shards) > 1 else ["model.safetensors"]
    )
    # Only the shards hold the tensors now, so each is freed once written.
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    weights.clear()

    weight_map = {}
    with tqdm(total=total_size, desc="Writing weights", unit="B", unit_scale=True,
              disable=None) as bar:
        for i, name in enumerate(names):
            shard, shards[i] = shards[i], None
            for value in shard.values():
                mx.eval(value)
                bar.update(value.nbytes)
            mx.save_safetensors(str(directory / name), shard, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(shard, name))
            del shard
    index = {
        "metadata": {"total_size": total_size, "total_parameters": total_parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return names


def write_config(config: dict, directory: Path) -> None:
    """Sorted, with the quantization mirrored into ``quantization_config`` (mlx-lm's
    ``save_config`` does the same but drops ``vision_config`` in older releases)."""
    from mlxvlm.checkpoint.loading import CONVERTED_MARKER

    config = dict(config)
    config.pop("_name_or_path", None)
    config[CONVERTED_MARKER] = CONVERTED_FORMAT_VERSION
    if config.get("quantization"):
        config["quantization_config"] = config["quantization"]
    else:
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4))


def copy_side_files(source: Path, directory: Path) -> None:
    from mlxvlm.retrieval.sentence_transformers_files import module_folders

    for pattern in SIDE_FILE_PATTERNS:
        for file in source.glob(pattern):
            if file.is_file() and file.name not in NOT_SIDE_FILES:
                shutil.copy2(file, directory / file.name)
    # sentence-transformers' module folders (1_Pooling/ ...): how an embedding model or
    # a reranker is recognized at load (mlxvlm/retrieval/detection.py).
    for folder in module_folders(source):
        shutil.copytree(source / folder, directory / folder, dirs_exist_ok=True)


@contextlib.contextmanager
def staged_checkpoint(model, config: dict, source: Path, staging: Path):
    """``staging``, a scratch directory, holding ``model`` as an MLX checkpoint (its
    weights, ``config`` and the side files of ``source``) for the with-block, which moves
    or converts it; removed afterwards, whatever happened."""
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        write_weights(model, staging)
        write_config(config, staging)
        copy_side_files(source, staging)
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# The Hub's task for each kind of model (by its retrieval use's kind; None: generative),
# as the original repos are tagged (vidore/colqwen2-v1.0-hf, Qwen/Qwen3-VL-Embedding-2B).
PIPELINE_TAGS = {
    None: "image-text-to-text",
    "multi_vector": "visual-document-retrieval",
    "single_vector": "sentence-similarity",
    "reranker": "text-ranking",
}


def usage(name: str, kind: str | None) -> str:
    """The card's usage snippet for a model of ``kind`` (see ``PIPELINE_TAGS``)."""
    if kind is None:
        shell = (f'python -m mlxvlm.generate --model {name} --image cat.jpg '
                 '--prompt "Describe this image."')
        python = 'print(mlxvlm.generate(model, processor, "Describe this image.", image="cat.jpg").text)'
    elif kind == "reranker":
        shell = f'python -m mlxvlm.embed --model {name} --query "a cat on a mat" --input-dir pictures/'
        python = ('print(mlxvlm.rerank(model, processor, "a cat on a mat", '
                  '["a dog in the park", {"image": "cat.jpg"}]))')
    else:
        shell = f"python -m mlxvlm.embed --model {name} --input-dir pictures/ --output index.jsonl"
        python = 'vectors = mlxvlm.embed(model, processor, ["a cat on a mat", {"image": "cat.jpg"}])'
    return f"""```bash
pip install mlxvlm
{shell}
```

```python
import mlxvlm

model, processor = mlxvlm.load("{name}")
{python}
```
"""


def write_model_card(directory: Path, *, name: str, base_model: str | None,
                     source: Path, precision: str, kind: str | None = None) -> None:
    """README.md with the Hub metadata and a usage snippet; ``kind``: the model's
    retrieval use's (None: a generative model)."""
    from huggingface_hub import ModelCard, ModelCardData

    import mlxvlm

    data = ModelCardData(
        library_name="mlx",
        pipeline_tag=PIPELINE_TAGS[kind],
        base_model=base_model,
        tags=["mlx", "mlxvlm"],
    )
    source_card = source / "README.md"
    if source_card.exists():  # keep the licence and languages of the original
        with contextlib.suppress(Exception):
            original = ModelCard.load(source_card).data
            data.license = original.license
            data.language = original.language
    origin = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "its original checkpoint"
    text = f"""# {name}

Converted to MLX from {origin} with mlxvlm {mlxvlm.__version__} ({precision}).

## Use with mlxvlm

{usage(name, kind)}"""
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}").save(directory / "README.md")


def upload(directory: Path, repo_id: str) -> None:
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", exist_ok=True)
        api.upload_large_folder(folder_path=str(directory), repo_id=repo_id, repo_type="model")
    except Exception as exc:  # auth, network and Hub errors alike: the output is kept
        raise MlxvlmError(
            f"uploading to {repo_id} failed ({type(exc).__name__}: {exc}); the converted "
            f"model is in {directory}"
        ) from None


def _describe_precision(quantization: dict | None, dtype: str | None) -> str:
    if not quantization:
        return dtype or "float"
    text = (f"{quantization['bits']}-bit {quantization['mode']} quantization, group size "
            f"{quantization['group_size']}")
    overrides = [v["bits"] for v in quantization.values() if isinstance(v, dict)]
    for bits in sorted(set(overrides)):
        text += f", {overrides.count(bits)} layers at {bits} bits"
    return text


def _human_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------ pipeline


def convert(
    hf_path: str,
    mlx_path: str | Path = "mlx_model",
    *,
    quantize: bool = False,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    q_mode: str | None = None,
    quant_predicate: str | None = None,
    quantize_vision: bool = False,
    dequantize: bool = False,
    dtype: str | None = None,
    upload_repo: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    force: bool = False,
) -> ConvertResult:
    """Convert ``hf_path`` into ``mlx_path``; the keyword arguments are the CLI's flags."""
    args = argparse.Namespace(
        quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, q_mode=q_mode,
        quant_predicate=quant_predicate, quantize_vision=quantize_vision,
        dequantize=dequantize, dtype=dtype,
    )
    plan = _plan(args)
    mlx_path = Path(mlx_path).expanduser()
    _check_destination(mlx_path, force)

    from mlxvlm.checkpoint.loading import read_config, resolve_model_path
    from mlxvlm.models import UnsupportedModelError, get_family
    from mlxvlm.checkpoint.quantization import TEXT_MODEL, read_quantization

    source = resolve_model_path(hf_path, revision, trust_remote_code)
    if mlx_path.resolve() == source.resolve() or source.resolve().is_relative_to(mlx_path.resolve()):
        raise MlxvlmError(f"--mlx-path {mlx_path} would overwrite the source checkpoint")
    config = read_config(source)
    try:
        family = get_family(config.get("model_type"))
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(
            f"{hf_path} is not a vision-language model mlxvlm supports: {exc}"
        ) from None
    source_quantization = read_quantization(config)
    if quantize and source_quantization:
        raise MlxvlmError(f"{hf_path} is already quantized; convert it with -d first")
    if dequantize and not source_quantization:
        raise MlxvlmError(f"{hf_path} is not quantized; there is nothing to dequantize")

    from mlxvlm.retrieval.detection import detect_use

    use = detect_use(config, source)  # an embedder's untied head may be absent
    model = _read_model(source, config, family,
                        head_optional=use is not None and not use.needs_output_head)
    target_dtype = plan.dtype or _source_dtype(config)
    if target_dtype is not None:
        _cast_floats(model, target_dtype)
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = target_dtype

    unquantized: list[str] = []
    if plan.spec is not None:
        model, config, unquantized = _quantize(model, config, plan, quantize_vision)
    if dequantize:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        if target_dtype is not None:  # dequantized weights take the scales' dtype
            _cast_floats(model, target_dtype)

    from mlx_lm.utils import compute_bits_per_weight

    bits_per_weight = compute_bits_per_weight(model)
    text_model = getattr(model, TEXT_MODEL, None)
    text_bits_per_weight = compute_bits_per_weight(text_model) if text_model is not None else None
    name = upload_repo or mlx_path.name
    base_model = None if Path(hf_path).expanduser().exists() else str(hf_path)
    quantization = config.get("quantization")
    precision = _describe_precision(quantization, target_dtype)

    staging = mlx_path.parent / f".{mlx_path.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        shards = write_weights(model, staging)
        write_config(config, staging)
        copy_side_files(source, staging)
        write_model_card(staging, name=name, base_model=base_model, source=source,
                         precision=precision, kind=None if use is None else use.kind)
        if mlx_path.is_dir() and not mlx_path.is_symlink():
            shutil.rmtree(mlx_path)
        elif mlx_path.exists() or mlx_path.is_symlink():
            mlx_path.unlink()
        staging.rename(mlx_path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise

    result = ConvertResult(
        path=mlx_path,
        shards=shards,
        size_bytes=sum((mlx_path / s).stat().st_size for s in shards),
        bits_per_weight=bits_per_weight,
        text_bits_per_weight=text_bits_per_weight,
        quantization=quantization,
        unquantized=unquantized,
    )
    if upload_repo is not None:
        upload(mlx_path, upload_repo)
    return result


def _quantize(model, config: dict, plan: _Plan, quantize_vision: bool):
    """mlx-lm's quantize_model with our choice of modules; returns the model, the config
    with its ``quantization`` and the modules left float for their shapes."""
    from mlx_lm.utils import quantize_model

    from mlxvlm.checkpoint.quantization import QuantizationError, conversion_predicate, left_unquantized

    spec = plan.spec
    predicate = conversion_predicate(
        len(model.layers), quantize_multimodal=quantize_vision, recipe=plan.recipe
    )
    unquantized = left_unquantized(model, predicate, spec)
    selected = [p for p, m in model.named_modules() if predicate(p, m)]
    if len(unquantized) == len(selected):
        raise QuantizationError(
            f"no layer can be quantized with group size {spec.group_size}: the input sizes "
            "do not divide by it"
        )
    # quantize_model prints its own bits-per-weight line; ours comes with the size on disk.
    with contextlib.redirect_stdout(io.StringIO()):
        model, config = quantize_model(
            model, config, spec.group_size, spec.bits, mode=spec.mode, quant_predicate=predicate
        )
    return model, config, unquantized


def main(argv: Sequence[str] | None = None) -> int:
    from mlxvlm.cli import run_cli

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return int(exit_.code or 0)

    def body() -> int:
        result = convert(
            args.hf_path, args.mlx_path, quantize=args.quantize, q_bits=args.q_bits,
            q_group_size=args.q_group_size, q_mode=args.q_mode,
            quant_predicate=args.quant_predicate, quantize_vision=args.quantize_vision,
            dequantize=args.dequantize, dtype=args.dtype, upload_repo=args.upload_repo,
            revision=args.revision, trust_remote_code=args.trust_remote_code, force=args.force,
        )
        if args.verbose and result.unquantized:
            print(f"Left unquantized (input size does not divide by the group size): "
                  f"{', '.join(result.unquantized)}", file=sys.stderr)
        print(result.report())
        return 0

    return run_cli(body)


if __name__ == "__main__":
    raise SystemExit(main())
