"""Make a model trainable: LoRA or DoRA adapters on its linear layers, or full fine-tuning.

LoRA and DoRA wrap the chosen linear layers in mlx-lm's ``LoRALinear`` / ``DoRALinear``
(on a quantized base that is QLoRA: the base stays quantized and frozen). By default they
go on every linear layer of the language model's decoder blocks (the last
``num_layers`` of them); ``train_vision`` adds the vision side (tower and projector).
Full fine-tuning unfreezes those blocks (and the vision side) whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear

from mlxvlm.checkpoint.adapters import hf_module_parts
from mlxvlm.errors import MlxvlmError

METHODS = ("lora", "dora", "full")
_LINEAR = (nn.Linear, nn.QuantizedLinear)


@dataclass
class TuningSummary:
    method: str
    modules: list[str]  # adapted (lora/dora) or unfrozen (full) module paths
    trainable_parameters: int
    total_parameters: int
    quantized_bases: int = 0  # adapted layers whose frozen base is quantized (QLoRA)

    def describe(self) -> str:
        share = 100 * self.trainable_parameters / max(self.total_parameters, 1)
        what = "modules adapted" if self.method != "full" else "blocks trained"
        qlora = f", {self.quantized_bases} on quantized weights (QLoRA)" if self.quantized_bases else ""
        return (
            f"{self.method}: {len(self.modules)} {what}{qlora}, {self.trainable_parameters:,} "
            f"trainable parameters ({share:.3f}% of {self.total_parameters:,})"
        )


def _block_paths(model: nn.Module, num_layers: int) -> list[str]:
    """Module paths of the last ``num_layers`` decoder blocks (all for a negative value)."""
    blocks = list(model.layers)
    wanted = blocks if num_layers < 0 else blocks[len(blocks) - min(num_layers, len(blocks)) :]
    ids = {id(block) for block in wanted}
    return [path for path, module in model.named_modules() if id(module) in ids]


def vision_paths(model: nn.Module) -> list[str]:
    """The model's parts beside the language model (the one holding the decoder blocks):
    vision tower, projector, connector... — at the top level, and inside any part that
    wraps the language model with them (an omni model's ``thinker``)."""
    first_block = _block_paths(model, 1)[0].split(".")
    paths, module, prefix = [], model, ""
    for part in first_block:
        children = module.children()
        if not isinstance(children.get(part), nn.Module):
            break
        paths += [prefix + name for name in children if name != part]
        if part == "language_model":
            break
        module, prefix = children[part], f"{prefix}{part}."
    return paths


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root + ".") for root in roots)


def _is_router(path: str, modules: dict) -> bool:
    """A mixture-of-experts router: a linear layer beside the experts. transformers keeps
    it as a bare weight, not a linear layer, so PEFT (and its "all-linear") never
    adapts it."""
    parent = modules.get(path.rpartition(".")[0])
    return parent is not None and any(
        isinstance(child, (SwitchGLU, SwitchMLP)) for child in parent.children().values()
    )


def candidate_linears(model: nn.Module, num_layers: int, train_vision: bool) -> list[str]:
    """The linear layers that can be adapted: in the tuned decoder blocks, and on the
    vision side with ``train_vision``; mixture-of-experts routers excepted."""
    roots = _block_paths(model, num_layers) + (vision_paths(model) if train_vision else [])
    modules = dict(model.named_modules())
    # Layers a family's blocks use as bare weights, not as layers (``untunable_linears``:
    # path suffixes), cannot be wrapped.
    untunable = tuple(getattr(model, "untunable_linears", ()))
    return sorted(
        path
        for path, module in modules.items()
        if isinstance(module, _LINEAR) and _under(path, roots) and not _is_router(path, modules)
        and not (untunable and path.endswith(untunable))
    )


def apply_tuning(
    model: nn.Module,
    method: str,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: list[str] | None = None,
    num_layers: int = -1,
    train_vision: bool = False,
) -> TuningSummary:
    """Freeze the model, then make the chosen part trainable (in place)."""
    if method not in METHODS:
        raise MlxvlmError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    model.freeze()
    if method == "full":
        modules = _unfreeze_full(model, num_layers, train_vision, target_modules)
    else:
        modules = _wrap_adapters(
            model, DoRALinear if method == "dora" else LoRALinear, rank, alpha, dropout,
            target_modules, num_layers, train_vision,
        )
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    quantized = sum(
        isinstance(getattr(m, "linear", None), nn.QuantizedLinear)
        for _, m in model.named_modules()
        if isinstance(m, (LoRALinear, DoRALinear))
    )
    return TuningSummary(method, modules, trainable, total, quantized)


def _wrap_adapters(model, layer_class, rank, alpha, dropout, target_modules, num_layers,
                   train_vision) -> list[str]:
    if rank < 1:
        raise MlxvlmError(f"--rank must be at least 1, not {rank}")
    candidates = candidate_linears(model, num_layers, train_vision)
    if target_modules:
        available = sorted({path.rpartition(".")[2] for path in candidates})
        unknown = sorted(set(target_modules) - set(available))
        if unknown:
            raise MlxvlmError(
                f"--target-modules {', '.join(unknown)} name no linear layer in the tuned "
                f"blocks (they have: {', '.join(available)})"
            )
        candidates = [p for p in candidates if p.rpartition(".")[2] in target_modules]
    modules = dict(model.named_modules())
    _check_peft_names(model, candidates)
    wrapped = [
        (path, layer_class.from_base(modules[path], r=rank, scale=alpha / rank, dropout=dropout))
        for path in candidates
    ]
    model.update_modules(tree_unflatten(wrapped))
    return candidates


def _check_peft_names(model: nn.Module, paths: list[str]) -> None:
    """Adapters are saved under transformers' module names: fail before training, not at
    the first checkpoint, when the family cannot give one."""
    for path in paths:
        try:
            hf_module_parts(model, path)
        except NotImplementedError as exc:
            raise MlxvlmError(
                f"an adapter on {path} could not be saved in PEFT's format: {exc}; choose "
                "other --target-modules (or leave out --train-vision)"
            ) from None


def _unfreeze_full(model, num_layers, train_vision, target_modules) -> list[str]:
    if target_modules:
        raise MlxvlmError("--target-modules applies to lora and dora, not to full fine-tuning")
    roots = _block_paths(model, num_layers) + (vision_paths(model) if train_vision else [])
    modules = dict(model.named_modules())
    quantized = [p for p, m in modules.items() if isinstance(m, nn.QuantizedLinear) and _under(p, roots)]
    if quantized:
        raise MlxvlmError(
            "full fine-tuning needs float weights but this checkpoint is quantized; train "
            "a LoRA adapter on it (QLoRA), or dequantize it first with "
            "`python -m mlxvlm.convert -d`"
        )
    for root in roots:
        modules[root].unfreeze()
    return roots
