"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors).

PEFT stores ``base_model.model.<HF module path>.lora_A.weight`` (r, in) and ``lora_B.weight``
(out, r) with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). mlx-lm's LoRALinear
computes ``y + scale * (x @ lora_a) @ lora_b``, so lora_a = A.T and lora_b = B.T. HF module
paths are mapped onto ours with the family's own ``sanitize``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.tuner.lora import LoRALinear

from mlxvlm.errors import CheckpointError

PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def read_adapter_config(adapter_path: Path) -> dict:
    config_file = adapter_path / CONFIG_FILE
    if not config_file.exists():
        raise CheckpointError(f"{adapter_path} has no {CONFIG_FILE}; is it a PEFT adapter?")
    config = json.loads(config_file.read_text())
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise CheckpointError(f"adapter type {peft_type!r} is not supported (only LoRA)")
    if config.get("use_dora"):
        raise CheckpointError("DoRA adapters are not supported yet; use a plain LoRA adapter")
    return config


def lora_scale(config: dict) -> float:
    r = config["r"]
    alpha = config.get("lora_alpha", r)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _hf_module_to_ours(model: nn.Module, hf_module: str) -> str:
    """Map an HF module path through the family's sanitize (names only)."""
    probe = {f"{hf_module}.weight": mx.zeros((1, 1))}
    mapped = list(model.sanitize(probe))
    if len(mapped) != 1 or not mapped[0].endswith(".weight"):
        raise CheckpointError(f"cannot map adapter module {hf_module!r} onto this model")
    return mapped[0][: -len(".weight")]


def load_adapter(model: nn.Module, adapter_path: str | Path) -> nn.Module:
    """Wrap the adapter's target linears in LoRALinear and load its weights, in place."""
    adapter_path = Path(adapter_path).expanduser()
    if not adapter_path.is_dir():
        raise CheckpointError(f"adapter directory {adapter_path} does not exist")
    config = read_adapter_config(adapter_path)
    weights_file = adapter_path / WEIGHTS_FILE
    if not weights_file.exists():
        raise CheckpointError(f"{adapter_path} has no {WEIGHTS_FILE}")
    tensors = mx.load(str(weights_file))

    pairs: dict[str, dict[str, mx.array]] = {}
    for name, value in tensors.items():
        if not name.startswith(PEFT_PREFIX):
            raise CheckpointError(f"unexpected tensor {name!r} in {weights_file}")
        module, _, kind = name[len(PEFT_PREFIX) :].rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise CheckpointError(f"unexpected tensor {name!r} in {weights_file}")
        pairs.setdefault(module, {})[kind[0]] = value

    modules = dict(model.named_modules())
    scale = lora_scale(config)
    replacements = []
    for hf_module, ab in pairs.items():
        ours = _hf_module_to_ours(model, hf_module)
        base = modules.get(ours)
        if base is None or not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
            raise CheckpointError(f"adapter targets {hf_module!r}, which is not a linear layer here")
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"adapter module {hf_module!r} lacks lora_A or lora_B")
        lora = LoRALinear.from_base(base, r=ab["A"].shape[0], scale=scale)
        lora.lora_a = ab["A"].T.astype(mx.float32)
        lora.lora_b = ab["B"].T.astype(mx.float32)
        replacements.append((ours, lora))
    model.update_modules(tree_unflatten(replacements))
    model.eval()
    mx.eval(model.parameters())
    return model
