"""LoRA and DoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors).

PEFT stores ``base_model.model.<HF module path>.lora_A.weight`` (r, in) and ``lora_B.weight``
(out, r), and for DoRA ``lora_magnitude_vector`` (out,), with ``scaling = lora_alpha / r``
(``/ sqrt(r)`` with rsLoRA; per module through ``alpha_pattern``/``rank_pattern``).
mlx-lm's LoRALinear computes ``y + scale * (x @ lora_a) @ lora_b`` and its DoRALinear
rescales that by ``m / ||W + scale * lora_b.T @ lora_a.T||`` per output row, exactly as
PEFT's DoRA layer does, so lora_a = A.T, lora_b = B.T and m = the magnitude vector.

HF module paths are mapped onto ours with the family's own ``sanitize`` when loading, and
ours onto HF's with ``hf_module_name`` (see ``models/base.py``) when saving.

A linear layer of ours that transformers splits in several (``hf_split_modules``: a fused
q/k/v) is saved as one PEFT module per part: each gets a copy of lora_A and its rows of
lora_B (and of DoRA's magnitude, which is per output row, so the split is exact). Loaded
back, parts sharing one lora_A make one adapter of that rank again; parts with their own
(as peft trains them) make one of the summed rank whose lora_B is block-diagonal, which
is exact too. A part the adapter leaves out keeps its base rows.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear

from mlxvlm.errors import CheckpointError

PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_LAYERS = (LoRALinear, DoRALinear)

# PEFT tensor suffix -> what it holds
_TENSOR_KINDS = {
    ".lora_A.weight": "A",
    ".lora_B.weight": "B",
    ".lora_magnitude_vector": "M",
    ".lora_magnitude_vector.weight": "M",  # PEFT releases before 0.12 saved it this way
}


# ------------------------------------------------------------------------------- config


def read_adapter_config(adapter_path: Path) -> dict:
    config_file = adapter_path / CONFIG_FILE
    if not config_file.exists():
        raise CheckpointError(f"{adapter_path} has no {CONFIG_FILE}; is it a PEFT adapter?")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from None
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise CheckpointError(f"adapter type {peft_type!r} is not supported (only LoRA and DoRA)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise CheckpointError("adapters that train biases (bias != 'none') are not supported")
    if config.get("modules_to_save"):
        raise CheckpointError(
            "adapters with modules_to_save (fully trained copies of modules) are not supported"
        )
    if config.get("target_parameters"):
        raise CheckpointError("adapters with target_parameters are not supported")
    return config


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module overrides: a key matches a module path it ends (after a dot)."""
    for key, value in (patterns or {}).items():
        if key == module or re.match(rf"(.*\.)?(?:{key})$", module):
            return value
    return default


def lora_scale(config: dict, hf_module: str = "", rank: int | None = None) -> float:
    """PEFT's ``scaling`` of one module (rank from its tensors when given)."""
    r = rank or _pattern_value(config.get("rank_pattern"), hf_module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern"), hf_module, config.get("lora_alpha", r))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


# ------------------------------------------------------------------------------- naming


def hf_module_parts(model: nn.Module, name: str) -> list[tuple[str, slice]]:
    """transformers' module paths for our linear layer ``name``, each with the rows of our
    output it holds: one module, or several where transformers splits the layer (see
    ``hf_split_modules``). Raises NotImplementedError where the family cannot name it."""
    split = getattr(model, "hf_split_modules", lambda _: None)(name)
    if not split:
        return [(model.hf_module_name(name), slice(None))]
    parts, start = [], 0
    for hf_module, rows in split:
        parts.append((hf_module, slice(start, start + rows)))
        start += rows
    return parts


def _split_modules(model: nn.Module) -> dict[str, tuple[str, list[tuple[str, slice]]]]:
    """``{hf_module: (ours, all its parts)}`` for the model's layers that transformers splits."""
    split = getattr(model, "hf_split_modules", None)
    found = {}
    for name, _ in model.named_modules() if split else ():
        if split(name):
            parts = hf_module_parts(model, name)
            found.update({hf_module: (name, parts) for hf_module, _ in parts})
    return found


def _join_parts(config: dict, ours: str, parts: list[tuple[str, slice]],
                present: dict[str, dict[str, mx.array]], magnitude: mx.array | None):
    """One adapter for our layer ``ours`` from the PEFT modules of its ``present`` parts:
    ``(tensors as set_adapter_weights takes them, rank, scale)``. ``magnitude`` (DoRA) is
    the layer's own, kept for the rows of parts the adapter leaves out."""
    ordered = [(hf, rows, present[hf]) for hf, rows in parts if hf in present]
    for hf, _, tensors in ordered:
        expected = {"A", "B", "M"} if magnitude is not None else {"A", "B"}
        if set(tensors) != expected:
            raise CheckpointError(
                f"adapter module {hf!r} has tensors {sorted(tensors)}, not {sorted(expected)} "
                "(A, B = lora_A, lora_B; M = lora_magnitude_vector)"
            )
    a_first = ordered[0][2]["A"]
    shared = all(t["A"].shape == a_first.shape and mx.array_equal(t["A"], a_first).item()
                 for _, _, t in ordered)
    scales = [lora_scale(config, hf, t["A"].shape[0]) for hf, _, t in ordered]
    scale = scales[0]
    rank = a_first.shape[0] if shared else sum(t["A"].shape[0] for _, _, t in ordered)
    out_dims = parts[-1][1].stop
    b = mx.zeros((out_dims, rank), mx.float32)
    m = None if magnitude is None else mx.array(magnitude, mx.float32)
    column = 0
    for (hf, rows, tensors), part_scale in zip(ordered, scales):
        part_b = tensors["B"].astype(mx.float32)
        r = tensors["A"].shape[0]
        if part_b.shape != (rows.stop - rows.start, r):
            raise CheckpointError(
                f"adapter module {hf!r} has lora_B of shape {tuple(part_b.shape)}, not "
                f"{(rows.stop - rows.start, r)} (its rows of {ours!r})"
            )
        if part_scale != scale:
            part_b = part_b * (part_scale / scale)
        columns = slice(0, r) if shared else slice(column, column + r)
        b[rows, columns] = part_b
        column += r
        if m is not None:
            m[rows] = tensors["M"].astype(mx.float32)
    a = a_first if shared else mx.concatenate([t["A"] for _, _, t in ordered], axis=0)
    joined = {"A": a, "B": b} if m is None else {"A": a, "B": b, "M": m}
    return joined, rank, scale


# ------------------------------------------------------------------------------ loading


def _hf_module_to_ours(model: nn.Module, hf_module: str) -> str:
    """Map an HF module path through the family's sanitize (names only)."""
    probe = {f"{hf_module}.weight": mx.zeros((1, 1))}
    mapped = list(model.sanitize(probe))
    if len(mapped) != 1 or not mapped[0].endswith(".weight"):
        raise CheckpointError(f"cannot map adapter module {hf_module!r} onto this model")
    return mapped[0][: -len(".weight")]


def read_adapter_tensors(adapter_path: Path) -> dict[str, dict[str, mx.array]]:
    """``{hf_module: {"A": (r, in), "B": (out, r)[, "M": (out,)]}}`` from the weights file."""
    weights_file = adapter_path / WEIGHTS_FILE
    if not weights_file.exists():
        raise CheckpointError(f"{adapter_path} has no {WEIGHTS_FILE}")
    modules: dict[str, dict[str, mx.array]] = {}
    for name, value in mx.load(str(weights_file)).items():
        suffix = next((s for s in _TENSOR_KINDS if name.endswith(s)), None)
        if not name.startswith(PEFT_PREFIX) or suffix is None:
            raise CheckpointError(f"unexpected tensor {name!r} in {weights_file}")
        module = name[len(PEFT_PREFIX) : -len(suffix)]
        modules.setdefault(module, {})[_TENSOR_KINDS[suffix]] = value
    return modules


def set_adapter_weights(layer: nn.Module, tensors: dict[str, mx.array], name: str) -> None:
    """Put one module's PEFT tensors into its LoRALinear/DoRALinear (float32)."""
    expected = {"A", "B", "M"} if isinstance(layer, DoRALinear) else {"A", "B"}
    if set(tensors) != expected:
        kind = "DoRA" if "M" in expected else "LoRA"
        raise CheckpointError(
            f"adapter module {name!r} has tensors {sorted(tensors)}; {kind} needs "
            f"{sorted(expected)} (A, B = lora_A, lora_B; M = lora_magnitude_vector)"
        )
    a, b = tensors["A"].T.astype(mx.float32), tensors["B"].T.astype(mx.float32)
    if a.shape != layer.lora_a.shape or b.shape != layer.lora_b.shape:
        raise CheckpointError(
            f"adapter module {name!r} has shapes A{tuple(tensors['A'].shape)} "
            f"B{tuple(tensors['B'].shape)}, which do not fit that layer"
        )
    layer.lora_a, layer.lora_b = a, b
    if "M" in tensors:
        layer.m = tensors["M"].astype(mx.float32)


def load_adapter(model: nn.Module, adapter_path: str | Path) -> nn.Module:
    """Wrap the adapter's target linears in LoRALinear/DoRALinear and load its weights,
    in place."""
    adapter_path = Path(adapter_path).expanduser()
    if not adapter_path.is_dir():
        raise CheckpointError(f"adapter directory {adapter_path} does not exist")
    config = read_adapter_config(adapter_path)
    tensors = read_adapter_tensors(adapter_path)
    layer_class = DoRALinear if config.get("use_dora") else LoRALinear

    modules = dict(model.named_modules())
    split = _split_modules(model)
    replacements = []
    joined: dict[str, dict[str, dict[str, mx.array]]] = {}  # ours -> {part: its tensors}
    for hf_module, module_tensors in tensors.items():
        if hf_module in split:
            joined.setdefault(split[hf_module][0], {})[hf_module] = module_tensors
            continue
        ours = _hf_module_to_ours(model, hf_module)
        base = modules.get(ours)
        if base is None or not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
            raise CheckpointError(f"adapter targets {hf_module!r}, which is not a linear layer here")
        if "A" not in module_tensors:
            raise CheckpointError(f"adapter module {hf_module!r} lacks lora_A")
        rank = module_tensors["A"].shape[0]
        layer = layer_class.from_base(base, r=rank, scale=lora_scale(config, hf_module, rank))
        set_adapter_weights(layer, module_tensors, hf_module)
        replacements.append((ours, layer))
    for ours, present in joined.items():
        base = modules[ours]
        if not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
            raise CheckpointError(f"adapter targets {sorted(present)}, not linear layers here")
        parts = split[next(iter(present))][1]
        # DoRA keeps the base's row norms as the magnitude of rows no part adapts.
        magnitude = DoRALinear.from_base(base, r=1).m if layer_class is DoRALinear else None
        module_tensors, rank, scale = _join_parts(config, ours, parts, present, magnitude)
        layer = layer_class.from_base(base, r=rank, scale=scale)
        set_adapter_weights(layer, module_tensors, ours)
        replacements.append((ours, layer))
    model.update_modules(tree_unflatten(replacements))
    model.eval()
    mx.eval(model.parameters())
    return model


def load_adapter_weights(model: nn.Module, adapter_path: str | Path) -> None:
    """Put an adapter's weights into the model's existing LoRA/DoRA layers (resuming a
    run): every layer must get its tensors and every tensor a layer."""
    adapter_path = Path(adapter_path)
    config = read_adapter_config(adapter_path)
    layers = dict(adapter_layers(model))
    tensors = read_adapter_tensors(adapter_path)
    split = _split_modules(model)
    found = {_hf_module_to_ours(model, hf): (hf, t) for hf, t in tensors.items() if hf not in split}
    joined: dict[str, dict[str, dict[str, mx.array]]] = {}
    for hf, t in tensors.items():
        if hf in split:
            joined.setdefault(split[hf][0], {})[hf] = t
    for ours, present in joined.items():
        parts = split[next(iter(present))][1]
        if ours not in layers:
            found[ours] = (ours, present)  # refused below: no layer to take it
            continue
        if len(present) != len(parts):
            raise CheckpointError(
                f"the adapter in {adapter_path} has {sorted(present)} but not all of "
                f"{[hf for hf, _ in parts]}, which are one layer here ({ours!r})"
            )
        magnitude = layers[ours].m if isinstance(layers[ours], DoRALinear) else None
        found[ours] = (ours, _join_parts(config, ours, parts, present, magnitude)[0])
    if set(found) != set(layers):
        missing = sorted(set(layers) - set(found)) or sorted(set(found) - set(layers))
        raise CheckpointError(
            f"the adapter in {adapter_path} does not cover the same layers as this model "
            f"(e.g. {missing[0]!r})"
        )
    for ours, (hf, module_tensors) in found.items():
        set_adapter_weights(layers[ours], module_tensors, hf)
    mx.eval(model.parameters())


# ------------------------------------------------------------------------------- saving


def adapter_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's LoRALinear/DoRALinear modules, with their paths."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ADAPTER_LAYERS)]


def _target_modules(model: nn.Module, adapted: dict[str, list[str]]) -> list[str]:
    """PEFT's ``target_modules`` for the adapted modules (ours -> their HF paths): the HF
    leaf names when those select nothing else in the model, else the full HF paths (PEFT
    matches a list entry against the end of each module path)."""
    hf_paths = sorted(hf for paths in adapted.values() for hf in paths)
    leaves = {hf.rpartition(".")[2] for hf in hf_paths}
    split = getattr(model, "hf_split_modules", lambda _: None)
    for name, _ in model.named_modules():
        # the base linear inside a wrapper is the adapted module itself
        if name in adapted or name.rpartition(".")[0] in adapted:
            continue
        names = [hf for hf, _ in split(name) or ()] or [name]
        if any(other.rpartition(".")[2] in leaves for other in names):
            return hf_paths
    return sorted(leaves)


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary file and rename it into place: a reader (or a run killed
    midway) only ever sees the old file or the complete new one."""
    # The name keeps its suffix: mx.save_safetensors appends ".safetensors" otherwise.
    temporary = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        write(temporary)
        with open(temporary, "rb") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def save_adapter(
    model: nn.Module,
    adapter_path: str | Path,
    *,
    alpha: float,
    dropout: float = 0.0,
    base_model: str | None = None,
) -> Path:
    """Write the model's LoRA/DoRA layers as a PEFT adapter that ``peft`` and
    ``load_adapter`` read. Every layer must share one rank and ``scale = alpha / rank``."""
    layers = adapter_layers(model)
    if not layers:
        raise CheckpointError("the model has no LoRA/DoRA layers to save")
    ranks = {layer.lora_a.shape[1] for _, layer in layers}
    kinds = {type(layer) for _, layer in layers}
    if len(ranks) != 1 or len(kinds) != 1:
        raise CheckpointError("all adapter layers must share one rank and one kind (LoRA or DoRA)")
    rank = ranks.pop()
    use_dora = kinds.pop() is DoRALinear

    tensors: dict[str, mx.array] = {}
    adapted: dict[str, list[str]] = {}
    for name, layer in layers:
        if not math.isclose(float(layer.scale), alpha / rank, rel_tol=1e-6):
            raise CheckpointError(
                f"layer {name!r} has scale {layer.scale}, not lora_alpha / r = {alpha / rank}"
            )
        try:
            parts = hf_module_parts(model, name)
        except NotImplementedError as exc:
            raise CheckpointError(str(exc)) from None
        out_dims = layer.lora_b.shape[1]
        if parts[-1][1].stop not in (None, out_dims):
            raise CheckpointError(
                f"layer {name!r} has {out_dims} outputs, but its transformers modules "
                f"{[hf for hf, _ in parts]} have {parts[-1][1].stop}"
            )
        adapted[name] = [hf for hf, _ in parts]
        for hf, rows in parts:  # a layer transformers splits: lora_A copied, rows of the rest
            prefix = f"{PEFT_PREFIX}{hf}"
            tensors[f"{prefix}.lora_A.weight"] = layer.lora_a.T
            tensors[f"{prefix}.lora_B.weight"] = layer.lora_b.T[rows]
            if use_dora:
                tensors[f"{prefix}.lora_magnitude_vector"] = layer.m[rows]
    tensors = {k: mx.contiguous(v.astype(mx.float32)) for k, v in tensors.items()}
    mx.eval(tensors)

    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": _target_modules(model, adapted),
        "use_dora": use_dora,
        "use_rslora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    adapter_path = Path(adapter_path)
    adapter_path.mkdir(parents=True, exist_ok=True)
    _atomic_write(
        adapter_path / WEIGHTS_FILE,
        lambda p: mx.save_safetensors(str(p), tensors, metadata={"format": "pt"}),
    )
    _atomic_write(adapter_path / CONFIG_FILE, lambda p: p.write_text(json.dumps(config, indent=2)))
    return adapter_path
