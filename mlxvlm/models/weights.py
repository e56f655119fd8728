"""Mapping a Hugging Face checkpoint's tensor names onto a family's (``sanitize``), and
telling the two namings apart (``is_hf_checkpoint``): the steps several families share.

A family keeps its own ``HF_PREFIXES`` table (``base.VisionLanguageModel.hf_module_name``
reads it to name modules the transformers way) and says what is special to it; these
helpers only run the loop.
"""

from __future__ import annotations

from typing import Callable, Collection, Iterable

import mlx.core as mx

# Rotary tables some checkpoints carry: recomputed from the config, never loaded.
ROTARY_BUFFERS = ("inv_freq",)

# Where transformers >= 4.52 saves a composite model's modules (its module tree).
MODULE_TREE_PREFIXES = ("model.", "lm_head.")


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
    tower: str | None = None,
    convert_tower: Callable[[str, mx.array], mx.array | None] | None = None,
    skip_prefixes: tuple[str, ...] = (),
    skip_suffixes: tuple[str, ...] = ROTARY_BUFFERS,
    drop: Collection[str] = (),
) -> dict[str, mx.array]:
    """A Hugging Face checkpoint's tensors under our names.

    Tensors whose Hugging Face name starts with ``skip_prefixes`` or ends with
    ``skip_suffixes`` (buffers recomputed here) are left out; the others are renamed by
    ``rename``. A tensor renamed under ``tower`` goes through ``convert_tower(name
    relative to the tower, value)``, which may change its layout or return None to leave
    it out. Renamed names in ``drop`` (e.g. a tied LM head) are left out last.
    """
    sanitized = {}
    for name, value in weights.items():
        if name.startswith(skip_prefixes) or name.endswith(skip_suffixes):
            continue
        name = rename(name)
        if tower is not None and name.startswith(tower):
            value = convert_tower(name[len(tower) :], value)
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
