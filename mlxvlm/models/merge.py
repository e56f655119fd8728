"""Putting a tower's feature tokens where the prompt has placeholder tokens: the step of
``embed`` every family shares (transformers' ``masked_scatter`` of image features).

The prompt is one sequence (batch 1), as the generate loop embeds one request at a time.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np


def placeholder_positions(ids: np.ndarray, token_id: int) -> np.ndarray:
    """Indices of ``token_id`` in the flat prompt ``ids``."""
    return np.flatnonzero(ids == token_id)


def merge_features(
    h: mx.array,
    positions: np.ndarray,
    features: mx.array | None,
    placeholders: str = "image tokens",
    source: str = "the vision tower",
) -> mx.array:
    """``h`` (1, length, width) with its rows at ``positions`` replaced by ``features``
    (tokens, width), one feature token per placeholder, in prompt order.

    ``features`` None means the request brought no pixels: then the prompt must hold no
    placeholders. Either mismatch (a prompt built for other images, or pixels without
    their placeholders) is raised as a ValueError that names the ``placeholders`` and the
    features' ``source``."""
    if features is None:
        if positions.size:
            raise ValueError(
                f"the prompt has {positions.size} {placeholders} but no pixel values were "
                "given for them"
            )
        return h
    if features.shape[0] != positions.size:
        raise ValueError(
            f"{source} gives {features.shape[0]} feature tokens but the prompt has "
            f"{positions.size} {placeholders} for them"
        )
    merged = h[0]
    merged[mx.array(positions)] = features.astype(h.dtype)
    return merged[None]


def embed_with_features(
    embed: Callable[[mx.array], mx.array],
    input_ids: mx.array,
    token_id: int,
    features: mx.array | None,
    placeholders: str = "image tokens",
    vocab_size: int | None = None,
) -> tuple[mx.array, np.ndarray]:
    """The prompt's embeddings, ``embed(input_ids)``, with ``features`` (any leading shape,
    the text width last) at the ``token_id`` placeholders; and the flat prompt ids.

    With ``vocab_size``, a placeholder id past the vocabulary (Gemma's image token) is
    looked up as 0: its embedding is replaced anyway."""
    ids = np.asarray(input_ids).reshape(-1)
    if vocab_size is not None and token_id >= vocab_size:
        input_ids = mx.array(np.where(ids == token_id, 0, ids).reshape(input_ids.shape))
    h = embed(input_ids)
    if features is not None:
        features = features.reshape(-1, h.shape[-1])
    return merge_features(h, placeholder_positions(ids, token_id), features, placeholders), ids


def embed_image_tokens(model, input_ids, pixel_values) -> tuple[mx.array, np.ndarray]:
    """``embed_with_features`` for a family whose placeholder is ``args.image_token_id``:
    ``input_ids`` through ``model.language_model.model.embed``, the image tokens replaced
    by ``model.image_features(pixel_values)`` (none without pixels)."""
    features = None if pixel_values is None else model.image_features(pixel_values)
    return embed_with_features(
        model.language_model.model.embed, input_ids, model.args.image_token_id, features,
        vocab_size=model.args.text.vocab_size,
    )
