"""The language model split over a group, before any weight is read.

``prepare`` runs on the module tree a family built from its config, still holding
random initial values: every rank but rank 0 drops the vision/audio towers (rank 0 runs
them, see ``group.ShardPlan``); in pipeline mode each rank keeps only its run of layers
(``pipeline`` of mlx-lm's ``PipelineMixin``, which mlx-lm's pipelined backbones and
mlxvlm's decoders run, or ``pipeline_split``'s skipped layers for a decoder without
one). The loader then reads only the weights the pruned tree still has (``keeps``):
mx.load maps safetensors lazily, so a tensor no rank needs is never read. ``shard`` runs
after the weights are loaded, still lazily: in tensor mode ``tensor_split`` slices every
attention, MLP, expert and Gated DeltaNet with mlx.nn's sharded layers, so each rank
materializes only its slice; in pipeline mode it connects the run's edges.

What cannot be split in the mode asked for is refused before anything is read, in one
line that names what works (the other mode, or fewer ranks).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.distributed import pipeline_split, tensor_split
from mlxvlm.distributed.group import ShardPlan
from mlxvlm.errors import MlxvlmError

TEXT_MODEL = "language_model"


def text_model_path(model: nn.Module) -> str:
    """Where the text model sits: ``language_model``, or deeper (Qwen3-Omni's
    ``thinker.language_model``)."""
    names = [name for name, _ in model.named_modules()
             if name == TEXT_MODEL or name.endswith(f".{TEXT_MODEL}")]
    if not names:
        raise MlxvlmError(f"{type(model).__module__} has no {TEXT_MODEL} to shard")
    return min(names, key=len)


def _module_at(model: nn.Module, path: str) -> nn.Module:
    module = model
    for part in path.split("."):
        module = module[part]
    return module


def _drop_towers(model: nn.Module, text_path: str) -> list[str]:
    """Replace every module beside the text model's path by an empty one and drop the
    arrays there (LLaVA-NeXT's ``image_newline``); returns the name prefixes of what was
    dropped."""
    dropped = []
    kept = (*getattr(model, "kept_on_every_rank", ()),)
    parent, prefix = model, ""
    for part in text_path.split("."):
        for name, child in list(parent.items()):
            if name == part or f"{prefix}{name}" in kept:
                continue
            if isinstance(child, nn.Module):
                parent[name] = nn.Module()
            elif isinstance(child, mx.array):
                del parent[name]
            else:
                continue
            dropped.append(f"{prefix}{name}")
        parent, prefix = parent[part], f"{prefix}{part}."
    return dropped


def _decoder(text_model: nn.Module) -> nn.Module:
    """The module that holds the blocks (``language_model.model`` in every family that
    can be sharded)."""
    return text_model["model"] if "model" in text_model else text_model


def _tensor_problem(family: str, decoder: nn.Module, size: int) -> str | None:
    why = tensor_split.problems(decoder.layers, size)
    if why is None:
        return None
    return f"the {family} text model cannot be split over {size} ranks in tensor mode ({why})"


def prepare(model: nn.Module, group: mx.distributed.Group, mode: str) -> tuple[ShardPlan, list[str]]:
    """Prune ``model`` for this rank (see the module docstring); returns the plan and the
    names of the modules and arrays whose weights this rank leaves unread. A model that
    cannot be split in ``mode`` raises one line naming the mode that works."""
    text_path = text_model_path(model)
    text_model = _module_at(model, text_path)
    family = type(model).__module__.rsplit(".", 1)[-1]
    size = group.size()
    decoder = _decoder(text_model)
    num_layers = len(decoder.layers)
    tensor_problem = _tensor_problem(family, decoder, size)
    if mode == "tensor" and tensor_problem is not None:
        raise MlxvlmError(tensor_problem + (
            "; run with --pipeline (each rank a run of layers)" if num_layers >= size
            else "; use fewer ranks"))
    if mode == "pipeline" and num_layers < size:
        raise MlxvlmError(f"{num_layers} layers cannot be split over {size} ranks; use at "
                          f"most {num_layers} ranks" + (
                              " or tensor mode (without --pipeline)"
                              if tensor_problem is None else ""))
    runs = pipeline_split.check(decoder, size, family) if mode == "pipeline" else None
    dropped = [] if group.rank() == 0 else _drop_towers(model, text_path)
    if mode == "tensor":
        return ShardPlan(group, mode, num_layers=num_layers), dropped
    layers_path = _layers_path(model, decoder)
    if _pipelines_itself(decoder):
        decoder.pipeline(group, runs)
        start, end = decoder.start_idx, decoder.end_idx
    else:  # its loop as it is, its layers replaced
        start, end = pipeline_split.prune(decoder, group, runs)
    dropped += [f"{layers_path}.{i}" for i in range(num_layers) if not start <= i < end]
    return ShardPlan(group, mode, (start, end), num_layers), dropped


def _pipelines_itself(decoder: nn.Module) -> bool:
    """mlx-lm's pipelined models and mlxvlm's decoders that say so run their own run of
    layers (``PipelineMixin``); the others get ``pipeline_split``'s layers."""
    return hasattr(decoder, "pipeline") and getattr(decoder, "runs_pipelined", True)


def _layers_path(model: nn.Module, decoder: nn.Module) -> str:
    first = id(decoder.layers[0])
    name = next(name for name, m in model.named_modules() if id(m) == first)
    return name.rsplit(".", 1)[0]


def keeps(name: str, dropped: list[str]) -> bool:
    """Whether the weight ``name`` (our naming) is one this rank reads: neither a dropped
    array nor under a dropped module."""
    return name not in dropped and not name.startswith(tuple(f"{d}." for d in dropped))


def shard(model: nn.Module, plan: ShardPlan) -> None:
    """Slice the loaded (still lazy) text model for tensor parallelism, or connect a
    pipeline rank's run of layers to the other ranks' (a decoder without a pipeline of
    its own; one with it was split by ``prepare``)."""
    decoder = _decoder(_module_at(model, text_model_path(model)))
    if plan.mode == "tensor":
        try:
            tensor_split.split_layers(decoder.layers, plan.group)
        except ValueError as exc:  # mlx.nn's own check, e.g. quantization groups cut
            raise MlxvlmError(
                f"the text model cannot be split over {plan.size} ranks in tensor mode "
                f"({exc}); run with --pipeline (each rank a run of layers)") from None
    elif not _pipelines_itself(decoder):
        pipeline_split.connect(decoder, plan.group)
