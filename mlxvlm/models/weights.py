"""Mapping a Hugging Face checkpoint's tensor names onto a family's (``sanitize``), and
telling the two namings apart (``is_hf_checkpoint``): the steps several families share.

A family keeps its own ``hf_prefixes`` table (``base.VisionLanguageModel`` renames by it
and reads it to name modules the transformers way) and says what is special to it;
these helpers only run the loop.
"""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Mapping

import mlx.core as mx

# Rotary tables some checkpoints carry: recomputed from the config, never loaded.
ROTARY_BUFFERS = ("inv_freq",)

# Where transformers >= 4.52 saves a composite model's modules (its module tree).
MODULE_TREE_PREFIXES = ("model.", "lm_head.")

# ``hf_prefixes`` entries, (Hugging Face prefix, ours), that several families share.
# transformers' module tree (>= 4.52) of a composite's text model, head and projector:
TEXT_MODEL_NAMES = ("model.language_model.", "language_model.model.")
LM_HEAD_NAMES = ("lm_head.", "language_model.lm_head.")
PROJECTOR_NAMES = ("model.multi_modal_projector.", "multi_modal_projector.")
# A SigLIP/CLIP/Pixtral tower, which our names nest under its ``vision_model.``:
NESTED_TOWER = "vision_tower.vision_model."
# transformers 5's module tree, which has no vision_model level (peft names adapters
# after it, so families list it before the tower's other names),
TOWER_MODULE_TREE = ("model.vision_tower.", NESTED_TOWER)
# transformers 4.52-4.57's module tree,
TOWER_MODULE_TREE_4 = ("model.vision_tower.vision_model.", NESTED_TOWER)
# transformers 5's save_pretrained outside the module tree (no vision_model level),
TOWER_SAVED = ("vision_tower.", NESTED_TOWER)
# and the Hub's original checkpoints, which name it as we do.
TOWER_HUB = (NESTED_TOWER, NESTED_TOWER)
NESTED_TOWER_NAMES = (TOWER_MODULE_TREE, TOWER_MODULE_TREE_4, TOWER_HUB, TOWER_SAVED)


def rename_prefix(name: str, prefixes: Iterable[tuple[str, str]]) -> str:
    """``name`` with its longest matching Hugging Face prefix of ``prefixes``
    (``(hf_prefix, ours)`` pairs) replaced by ours; unchanged if none matches.

    Longest, not first: the table's order is then free to say which of several Hugging
    Face prefixes of one of ours is transformers' module tree (listed first), which
    ``VisionLanguageModel.hf_module_name`` relies on to name adapters as peft does."""
    matches = [(hf, ours) for hf, ours in prefixes if name.startswith(hf)]
    if not matches:
        return name
    prefix, replacement = max(matches, key=lambda pair: len(pair[0]))
    return replacement + name[len(prefix) :]


def is_hf_naming(names: Iterable[str], hf_prefixes: tuple[str, ...],
                 our_prefixes: tuple[str, ...] = ()) -> bool:
    """Whether some of ``names`` start with ``hf_prefixes``: a Hugging Face checkpoint's.
    Names under both ``hf_prefixes`` and ``our_prefixes`` at once are neither layout: a
    ValueError names one of each."""
    names = list(names)
    hf = [n for n in names if n.startswith(hf_prefixes)]
    ours = [n for n in names if n.startswith(our_prefixes)] if hf and our_prefixes else []
    if ours:
        raise ValueError(
            f"the checkpoint mixes Hugging Face tensor names (e.g. {hf[0]!r}) with MLX ones "
            f"(e.g. {ours[0]!r}); it is neither layout"
        )
    return bool(hf)


# Tensors only quantized (converted) checkpoints have.
QUANTIZED_SUFFIXES = (".scales", ".biases")


def is_hf_unless_quantized(names: Iterable[str], hf_only: Callable[[str], bool]) -> bool:
    """``is_hf_checkpoint`` for a family whose Hugging Face names may equal its own (the
    Hub's originals, or transformers 5's save_pretrained, name the modules as
    mlx-community does; only a tensor's layout differs): quantized tensors mean an MLX
    conversion, anything else is taken for Hugging Face's. The loader recognises float
    conversions first, by how their writer marked them (``checkpoint.loading.is_converted``).
    ``hf_only(name)``: whether only a Hugging Face checkpoint has ``name``; a checkpoint
    with such names and quantized ones is neither layout (ValueError)."""
    names = list(names)
    quantized = [n for n in names if n.endswith(QUANTIZED_SUFFIXES)]
    hf = [n for n in names if hf_only(n)]
    if quantized and hf:
        raise ValueError(
            f"the checkpoint mixes Hugging Face tensor names (e.g. {hf[0]!r}) with "
            f"quantized MLX ones (e.g. {quantized[0]!r}); it is neither layout"
        )
    return not quantized


def has_transformers_names(names: Iterable[str], tower: str = "vision_tower.",
                           ours: str = "vision_tower.vision_model.") -> bool:
    """Whether any name is one only transformers writes: the module tree (``model.*``, ``lm_head.*``), or
    a vision tower saved directly under ``tower`` where our names nest it under ``ours``
    (transformers 5 drops the tower's ``vision_model.`` level)."""
    return any(
        name.startswith(MODULE_TREE_PREFIXES)
        or (name.startswith(tower) and not name.startswith(ours))
        for name in names
    )


def map_hf_weights(
    weights: dict[str, mx.array],
    rename: Callable[[str], str],
    *,
    towers: Mapping[str, Callable[[str, mx.array], mx.array | None]] | None = None,
    skip_prefixes: tuple[str, ...] = (),
    skip_suffixes: tuple[str, ...] = ROTARY_BUFFERS,
    drop: Collection[str] = (),
) -> dict[str, mx.array]:
    """A Hugging Face checkpoint's tensors under our names.

    Tensors whose Hugging Face name starts with ``skip_prefixes`` or ends with
    ``skip_suffixes`` (buffers recomputed here) are left out; the others are renamed by
    ``rename``. A tensor renamed under a tower prefix of ``towers`` goes through its
    converter, ``convert(name relative to the tower, value)``, which may change its
    layout or return None to leave it out. Renamed names in ``drop`` (e.g. a tied LM
    head) are left out last.
    """
    towers = towers or {}
    sanitized = {}
    for name, value in weights.items():
        if name.startswith(skip_prefixes) or name.endswith(skip_suffixes):
            continue
        name = rename(name)
        tower = next((t for t in towers if name.startswith(t)), None)
        if tower is not None:
            value = towers[tower](name[len(tower) :], value)
            if value is None:
                continue
        if name not in drop:
            sanitized[name] = value
    return sanitized


def tie_lm_head(weights: dict[str, mx.array], lm_head: str, embed_tokens: str) -> dict[str, mx.array]:
    """Store the embedding's array (shared, not copied) under the head's name when the
    checkpoint leaves the tied head out; mlx-community's conversions always store it."""
    if lm_head not in weights and embed_tokens in weights:
        weights[lm_head] = weights[embed_tokens]
    return weights


def fuse_linears(weights: dict[str, mx.array], under: str, parts: tuple[str, ...],
                 fused: str) -> dict[str, mx.array]:
    """Linear layers named ``<module>.<part>.<weight|bias>`` (each of ``parts``, e.g.
    separate attention q / k / v) under the prefix ``under`` stored as one
    ``<module>.<fused>.*``, stacked along the output in the order of ``parts``."""
    out: dict[str, mx.array] = {}
    groups: dict[str, dict[str, mx.array]] = {}
    for name, value in weights.items():
        module, part, leaf = (name.rsplit(".", 2) + ["", ""])[:3]
        if name.startswith(under) and part in parts:
            groups.setdefault(f"{module}.{fused}.{leaf}", {})[part] = value
        else:
            out[name] = value
    for name, pieces in groups.items():
        out[name] = mx.concatenate([pieces[part] for part in parts], axis=0)
    return out
