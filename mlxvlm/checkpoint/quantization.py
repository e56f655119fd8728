"""Weight quantization: the settings `convert` writes and `load` reads.

The layout is mlx-lm's, which mlx-community's checkpoints (made with mlx-vlm) carry in
``config.json``::

    "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                     "language_model.lm_head": {"group_size": 64, "bits": 8, "mode": "affine"},
                     "language_model.model.layers.0.mlp.gate_proj": false}

Top-level keys are the defaults; a module path maps to its own settings or to ``false``
(left in float). Older configs have no ``mode`` (affine). A module that the config does
not name is quantized exactly when the checkpoint holds its ``scales``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.errors import CheckpointError, MlxvlmError

# mode -> (default group size, default bits), as mlx-lm's quantize_model.
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)

# Mixed-precision recipe -> (bits of most layers, bits of the sensitive ones). The names
# of mlx-lm's recipes, plus mixed_4_8.
RECIPES = {
    "mixed_2_6": (2, 6),
    "mixed_3_4": (3, 4),
    "mixed_3_6": (3, 6),
    "mixed_4_6": (4, 6),
    "mixed_4_8": (4, 8),
}

# Every family names its text decoder `language_model` (as mlx-community's checkpoints
# do), at the top or inside an omni model's `thinker`; everything else — vision/audio
# towers and projectors — is multimodal.
TEXT_MODEL = "language_model"
# An omni model's talker (codec codes out of a decoder, Qwen3-Omni's and Qwen2.5-Omni's)
# is quantized as the text decoder is; its codec (Qwen3-Omni's code2wav: convolutions and
# a small transformer; Qwen2.5-Omni's token2wav: a DiT integrated over ten ODE steps and
# BigVGAN; errors reach the waveform directly) always stays float.
TEXT_MODEL_PATHS = (TEXT_MODEL, f"thinker.{TEXT_MODEL}", "talker")
NEVER_QUANTIZED_PATHS = ("code2wav", "token2wav")

Predicate = Callable[[str, nn.Module], "bool | dict"]


class QuantizationError(MlxvlmError, ValueError):
    """Quantization settings that MLX cannot apply."""


@dataclass(frozen=True)
class QuantSpec:
    group_size: int
    bits: int
    mode: str = "affine"

    def as_dict(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def describe(self) -> str:
        return f"{self.bits}-bit {self.mode}, group size {self.group_size}"


def quant_spec(mode: str | None = None, bits: int | None = None, group_size: int | None = None) -> QuantSpec:
    """Validated settings; missing ones take the mode's defaults."""
    mode = mode or "affine"
    if mode not in MODE_DEFAULTS:
        raise QuantizationError(
            f"unknown quantization mode {mode!r} (choose from {', '.join(MODE_DEFAULTS)})"
        )
    default_group_size, default_bits = MODE_DEFAULTS[mode]
    group_size = default_group_size if group_size is None else group_size
    bits = default_bits if bits is None else bits
    if mode == "affine":
        if bits not in AFFINE_BITS:
            raise QuantizationError(
                f"affine quantization takes {', '.join(map(str, AFFINE_BITS))} bits, not {bits}"
            )
        if group_size not in AFFINE_GROUP_SIZES:
            raise QuantizationError(
                f"group size {group_size} is not possible: affine quantization takes "
                f"{', '.join(map(str, AFFINE_GROUP_SIZES))}"
            )
    elif (group_size, bits) != (default_group_size, default_bits):
        raise QuantizationError(
            f"{mode} quantization needs group size {default_group_size} and "
            f"{default_bits} bits (got group size {group_size}, {bits} bits)"
        )
    return QuantSpec(group_size, bits, mode)


def recipe_spec(recipe: str, group_size: int | None = None) -> tuple[QuantSpec, QuantSpec]:
    """(low, high) settings of a mixed recipe; recipes are affine."""
    if recipe not in RECIPES:
        raise QuantizationError(
            f"unknown quantization recipe {recipe!r} (choose from {', '.join(RECIPES)})"
        )
    low, high = RECIPES[recipe]
    return quant_spec("affine", low, group_size), quant_spec("affine", high, group_size)


# --------------------------------------------------------------------------- converting


def is_multimodal_path(path: str) -> bool:
    return not _under(path, TEXT_MODEL_PATHS)


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == prefix or path.startswith(f"{prefix}.") for prefix in prefixes)


def _block_index(path: str) -> int | None:
    """The decoder block a module path lies in (``...layers.<i>...``), if any."""
    parts = path.split(".")
    for name, index in zip(parts, parts[1:]):
        if name == "layers" and index.isdigit():
            return int(index)
    return None


def sensitive_block(index: int, num_blocks: int) -> bool:
    """llama.cpp's Q4_K_M choice (as in mlx-lm's recipes): the first and last eighth of the
    blocks (at least the first and the last one) and every third block in between."""
    eighth = num_blocks // 8
    return (
        index < max(1, eighth)
        or index >= min(7 * num_blocks // 8, num_blocks - 1)
        or (index - eighth) % 3 == 2
    )


def conversion_predicate(
    num_blocks: int,
    *,
    quantize_multimodal: bool = False,
    recipe: tuple[QuantSpec, QuantSpec] | None = None,
) -> Predicate:
    """Which modules to quantize, and how, for mlx-lm's ``quantize_model``.

    Returns True (the default settings), False, or the settings of a per-layer override.
    Towers and projectors stay float unless ``quantize_multimodal``. With a mixed
    ``recipe`` the embeddings, the LM head, v_proj and down_proj of the sensitive blocks
    and any quantized tower get the high bits; the rest the low (default) ones.
    """

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized") or _under(path, NEVER_QUANTIZED_PATHS):
            return False
        multimodal = is_multimodal_path(path)
        if multimodal and not quantize_multimodal:
            return False
        if recipe is None:
            return True
        _, high = recipe
        leaf = path.rsplit(".", 1)[-1]
        block = _block_index(path)
        if (
            multimodal
            or isinstance(module, nn.Embedding)
            or leaf == "lm_head"
            or (
                leaf in ("v_proj", "down_proj")
                and block is not None
                and sensitive_block(block, num_blocks)
            )
        ):
            return high.as_dict()
        return True

    return predicate


def left_unquantized(model: nn.Module, predicate: Predicate, spec: QuantSpec) -> list[str]:
    """Modules the predicate selects whose input size does not divide by the group size
    (mlx-lm's quantize_model skips those; they stay float)."""
    skipped = []
    for path, module in model.named_modules():
        choice = predicate(path, module)
        if not choice:
            continue
        group_size = choice["group_size"] if isinstance(choice, dict) else spec.group_size
        if module.weight.shape[-1] % group_size:
            skipped.append(path)
    return sorted(skipped)


# ------------------------------------------------------------------------------ loading


def read_quantization(config: dict) -> dict | None:
    """The checkpoint's MLX quantization settings, or None for a float checkpoint."""
    quantization = config.get("quantization")
    if quantization:
        return quantization
    # Some early MLX conversions wrote only the mirror.
    legacy = config.get("quantization_config")
    if isinstance(legacy, dict) and "bits" in legacy and "quant_method" not in legacy:
        return legacy
    return None


def _module_settings(path: str, module: nn.Module, weights: dict[str, mx.array]) -> dict:
    """Settings recovered from the stored shapes, for a module the config does not name
    (its defaults may not fit it, e.g. a layer another tool packed differently)."""
    from mlx_lm.utils import infer_quant_config

    try:
        return infer_quant_config(path, module, weights)
    except (ValueError, KeyError, ZeroDivisionError) as exc:
        raise CheckpointError(f"cannot read the quantization of {path}: {exc}") from None


def loading_predicate(quantization: dict, weights: dict[str, mx.array]) -> Predicate:
    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized"):
            return False
        override = quantization.get(path)
        if override is False or f"{path}.scales" not in weights:
            return False
        if isinstance(override, dict):
            return {k: override[k] for k in ("group_size", "bits", "mode") if k in override}
        return _module_settings(path, module, weights)

    return predicate


def apply_quantization(model: nn.Module, config: dict, weights: dict[str, mx.array]) -> None:
    """Swap in quantized layers where the checkpoint stores quantized weights."""
    quantization = read_quantization(config)
    if quantization is None:
        return
    nn.quantize(
        model,
        group_size=quantization.get("group_size", 64),
        bits=quantization.get("bits", 4),
        mode=quantization.get("mode", "affine"),
        class_predicate=loading_predicate(quantization, weights),
    )
