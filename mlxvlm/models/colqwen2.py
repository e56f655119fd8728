"""ColQwen2 (Faysse et al., 2024; transformers' ``ColQwen2ForRetrieval``): a Qwen2-VL
whose last hidden states, projected by ``embedding_proj_layer`` to a small width and
L2-normalized, are one retrieval vector per token (late interaction, ColBERT's MaxSim).

A variant of the Qwen2-VL family: its tower and decoder, built from the checkpoint's
``vlm_config``. It has no output head (its text config is read as tied, so none is
built) and never generates: ``mlxvlm.retrieval.colvision`` holds its prompts.

transformers runs the decoder with ``position_ids=None`` and without the image grids, so
every token, an image's included, sits at its plain 1-D position (no M-RoPE):
``retrieval_vectors`` does the same.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.models import qwen2_vl
from mlxvlm.models.qwen_vl_base import HF_PREFIXES, ModelArgs

# transformers' module tree nests the Qwen2-VL model under ``vlm.``; the Hub's
# vidore checkpoints were saved with the older ``vlm.model.*`` names.
VLM_PREFIXES = tuple((f"vlm.{hf}", ours) for hf, ours in HF_PREFIXES) + (
    ("vlm.visual.", "vision_tower."),
    ("vlm.language_model.", "language_model.model."),
)
# The retrieval checkpoints some tools save keep the generation head of the backbone.
UNUSED = ("vlm.lm_head.", "lm_head.", "language_model.lm_head.")


def projected_vectors(hidden: mx.array, projection: nn.Linear) -> mx.array:
    """Each token's retrieval vector: the projection of its last hidden state, L2-normalized
    (as transformers divides by the norm: a zero vector stays NaN there too)."""
    vectors = projection(hidden)
    return vectors / mx.linalg.norm(vectors, axis=-1, keepdims=True)


class Model(qwen2_vl.Model):
    hf_prefixes = VLM_PREFIXES
    mlx_prefixes = ("vision_tower.", "language_model.")  # embedding_proj_layer: both
    unused_weight_prefixes = UNUSED
    # A text query or a page image, never a video (transformers' processor takes none).
    processor_videos = False

    def __init__(self, args: ModelArgs, embedding_dim: int):
        super().__init__(args)
        self.embedding_dim = embedding_dim
        self.embedding_proj_layer = nn.Linear(args.text.hidden_size, embedding_dim)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        vlm = config.get("vlm_config") or {}
        args = ModelArgs.from_hf(vlm, qwen2_vl.vision_config_from_hf(vlm))
        args.text = dataclasses.replace(args.text, tie_word_embeddings=True)
        return cls(args, config.get("embedding_dim", 128))

    def retrieval_vectors(self, input_ids: mx.array, pixel_values=None,
                          image_grid_thw=None) -> mx.array:
        """(B, L, embedding_dim) normalized vectors for a right-padded batch of prompts;
        ``pixel_values``/``image_grid_thw``: the processor's, for the batch's images in
        row order. Attention is causal, so a row's padding after its tokens changes none
        of them."""
        batch, length = input_ids.shape
        # The placeholders of all rows, in row order, take the images' tokens in order.
        h, *_ = self.embed_vision(input_ids.reshape(1, batch * length),
                                  pixel_values=pixel_values, image_grid_thw=image_grid_thw)
        hidden = self.language_model.model(None, None, h.reshape(batch, length, -1), None)
        return projected_vectors(hidden, self.embedding_proj_layer)


is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
