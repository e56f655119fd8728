"""ColPali (Faysse et al., 2024; transformers' ``ColPaliForRetrieval``): a PaliGemma whose
last hidden states, projected by ``embedding_proj_layer`` and L2-normalized, are one
retrieval vector per token (late interaction, ColBERT's MaxSim).

A variant of the PaliGemma family: its SigLIP tower, projector and Gemma decoder (the
Gemma 1 of PaliGemma-3B, which ``vidore/colpali-v1.3-hf`` is built on, or Gemma 2),
built from the checkpoint's ``vlm_config``. It never generates:
``mlxvlm.retrieval.colvision`` holds its prompts. ColPali's processor marks every token
as prefix, so each prompt attends to itself in both directions, as transformers runs it.
"""

from __future__ import annotations

from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.models import paligemma
from mlxvlm.models.multi_vector import UNUSED_HEADS, projected_vectors, under_vlm

# transformers 5's module tree (``vlm.language_model.*``, ``vlm.vision_tower.*``,
# ``vlm.multi_modal_projector.*``) and the Hub's older PaliGemma names under ``vlm.``.
VLM_PREFIXES = under_vlm(paligemma.HF_PREFIXES) + (
    ("vlm.language_model.", "language_model.model."),
    ("vlm.language_model.model.", "language_model.model."),
    ("vlm.multi_modal_projector.", "multi_modal_projector."),
)


class Model(paligemma.Model):
    hf_prefixes = VLM_PREFIXES
    unused_weight_prefixes = UNUSED_HEADS

    def __init__(self, args: paligemma.ModelArgs, embedding_dim: int):
        super().__init__(args)
        self.embedding_dim = embedding_dim
        self.embedding_proj_layer = nn.Linear(args.text.hidden_size, embedding_dim)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        args = paligemma.ModelArgs.from_hf(config.get("vlm_config") or {},
                                           text_models=("gemma", "gemma2"))
        return cls(args, config.get("embedding_dim", 128))

    @classmethod
    def is_hf_checkpoint(cls, weight_names: Iterable[str]) -> bool:
        return any(name.startswith("vlm.") for name in weight_names)

    def retrieval_vectors(self, input_ids: mx.array, lengths: mx.array,
                          pixel_values: Any = None) -> mx.array:
        """(B, L, embedding_dim) normalized vectors for a right-padded batch of prompts
        (``lengths``: each row's tokens; ``pixel_values``: the batch's images in row
        order). Each row attends within its own tokens only."""
        batch, length = input_ids.shape
        # The placeholders of all rows, in row order, take the images' tokens in order.
        h, _ = self.embed(input_ids.reshape(1, batch * length), pixel_values)
        text_model = self.language_model.model
        hidden = text_model(h.reshape(batch, length, -1), [None] * len(text_model.layers),
                            length, text_model.padded_masks(lengths, length))
        return projected_vectors(hidden, self.embedding_proj_layer)


is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
