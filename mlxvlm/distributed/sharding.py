"""The language model split over a group, before any weight is read.

``prepare`` runs on the module tree a family built from its config, still holding
random initial values: every rank but rank 0 drops the vision/audio towers (rank 0 runs
them, see ``group.ShardPlan``); in pipeline mode each rank keeps only its run of layers
(``pipeline`` of mlx-lm's ``PipelineMixin``, which mlx-lm's backbones and mlxvlm's M-RoPE
decoder carry). The loader then reads only the weights the pruned tree still has
(``keeps``): mx.load maps safetensors lazily, so a tensor no rank needs is never read.
``shard`` runs after the weights are loaded, still lazily: the text model's own
``shard(group)`` (mlx-lm's, or the M-RoPE decoder's) slices every attention and MLP with
mlx.nn's sharded linear layers, so each rank materializes only its slice, and the
slices' all-reduce is in those layers.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

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
    parent, prefix = model, ""
    for part in text_path.split("."):
        for name, child in list(parent.items()):
            if name == part:
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


def _attention_heads(text_model: nn.Module) -> tuple[int, int]:
    attention = _decoder(text_model).layers[0].self_attn
    return attention.n_heads, attention.n_kv_heads


def prepare(model: nn.Module, group: mx.distributed.Group, mode: str) -> tuple[ShardPlan, list[str]]:
    """Prune ``model`` for this rank (see the module docstring); returns the plan and the
    names of the modules and arrays whose weights this rank leaves unread."""
    text_path = text_model_path(model)
    text_model = _module_at(model, text_path)
    family = type(model).__module__.rsplit(".", 1)[-1]
    size = group.size()
    num_layers = len(_decoder(text_model).layers)
    dropped = [] if group.rank() == 0 else _drop_towers(model, text_path)
    if mode == "tensor":
        if not hasattr(text_model, "shard"):
            raise MlxvlmError(
                f"the {family} text model has no tensor-parallel split; try --pipeline")
        heads, kv_heads = _attention_heads(text_model)
        if heads % size or kv_heads % size:
            raise MlxvlmError(
                f"the {family} text model's {heads} attention heads ({kv_heads} key/value "
                f"heads) do not split over {size} ranks; use --pipeline or a rank count "
                "that divides both")
        return ShardPlan(group, mode, num_layers=num_layers), dropped
    decoder = _decoder(text_model)
    # mlx-lm's pipelined models all run it; mlxvlm's decoders say which do.
    if not hasattr(decoder, "pipeline") or not getattr(decoder, "runs_pipelined", True):
        raise MlxvlmError(
            f"the {family} text model has no pipeline split; run without --pipeline "
            "(tensor parallelism)")
    if num_layers < size:
        raise MlxvlmError(f"{num_layers} layers cannot be split over {size} ranks")
    layers_path = _layers_path(model, decoder)
    decoder.pipeline(group)
    start, end = decoder.start_idx, decoder.end_idx
    dropped += [f"{layers_path}.{i}" for i in range(num_layers) if not start <= i < end]
    return ShardPlan(group, mode, (start, end), num_layers), dropped


def _layers_path(model: nn.Module, decoder: nn.Module) -> str:
    first = id(decoder.layers[0])
    name = next(name for name, m in model.named_modules() if id(m) == first)
    return name.rsplit(".", 1)[0]


def keeps(name: str, dropped: list[str]) -> bool:
    """Whether the weight ``name`` (our naming) is one this rank reads: neither a dropped
    array nor under a dropped module."""
    return name not in dropped and not name.startswith(tuple(f"{d}." for d in dropped))


def shard(model: nn.Module, plan: ShardPlan) -> None:
    """Slice the loaded (still lazy) text model for tensor parallelism; pipeline plans
    were applied by ``prepare``."""
    if plan.mode == "tensor":
        _module_at(model, text_model_path(model)).shard(plan.group)
