"""What the multi-vector retrieval variants (ColQwen2, ColPali) share: transformers nests
their backbone under ``vlm.``, and each token's last hidden state, projected by
``embedding_proj_layer`` and L2-normalized, is its retrieval vector."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# The retrieval checkpoints some tools save keep the backbone's generation head.
UNUSED_HEADS = ("vlm.lm_head.", "vlm.language_model.lm_head.", "lm_head.",
                "language_model.lm_head.")


def under_vlm(prefixes: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """A backbone family's ``hf_prefixes`` as the retrieval model's checkpoint names them."""
    return tuple((f"vlm.{hf}", ours) for hf, ours in prefixes)


def projected_vectors(hidden: mx.array, projection: nn.Linear) -> mx.array:
    """Each token's retrieval vector: the projection of its last hidden state, divided by
    its norm (as transformers divides)."""
    vectors = projection(hidden)
    return vectors / mx.linalg.norm(vectors, axis=-1, keepdims=True)
