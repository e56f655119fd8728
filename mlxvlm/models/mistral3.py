"""Mistral 3 (Mistral Small 3.1/3.2): Pixtral's vision tower, a projector that first merges
each ``spatial_merge_size`` x ``spatial_merge_size`` block of patches into one token (a
learned linear map over the block's concatenated features), and a Mistral decoder
(mlx-lm's). Images are prompted as in Pixtral, one ``[IMG]`` per merged token.

Checkpoint names (mlx-community's): ``vision_tower.vision_model.*``,
``multi_modal_projector.{norm, patch_merger.merging_layer, linear_1, linear_2}``,
``language_model.model.*``, ``language_model.lm_head`` unless tied.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import pixtral
from mlxvlm.models.layers.activations import activation


class PatchMerger(nn.Module):
    """Each merge block of an image's patch grid -> one token: the block's features
    concatenated channel-major (as torch's ``unfold``), then ``merging_layer``."""

    def __init__(self, width: int, merge: int):
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(width * merge * merge, width, bias=False)

    def __call__(self, features: mx.array, grid: tuple[int, int]) -> mx.array:
        (h, w), m = grid, self.merge
        d = features.shape[-1]
        blocks = features.reshape(h // m, m, w // m, m, d).transpose(0, 2, 4, 1, 3)
        return self.merging_layer(blocks.reshape(-1, d * m * m))


class Projector(nn.Module):
    """``multi_modal_projector``: RMSNorm -> patch merger -> linear -> act -> linear."""

    def __init__(self, args: pixtral.ModelArgs, merge: int, rms_norm_eps: float):
        super().__init__()
        width = args.vision.hidden_size * pixtral.num_feature_layers(args.vision_feature_layer)
        text_width = args.text.hidden_size
        self.norm = nn.RMSNorm(width, eps=rms_norm_eps)
        self.patch_merger = PatchMerger(width, merge)
        self.linear_1 = nn.Linear(width, text_width, bias=args.projector_bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=args.projector_bias)
        self.act = activation(args.projector_hidden_act)

    def __call__(self, features: mx.array, grid: tuple[int, int]) -> mx.array:
        x = self.patch_merger(self.norm(features), grid)
        return self.linear_2(self.act(self.linear_1(x)))


class Model(pixtral.PixtralFamilyModel):
    def __init__(self, args: pixtral.ModelArgs, spatial_merge_size: int):
        super().__init__(args)
        self.spatial_merge_size = spatial_merge_size
        self.multi_modal_projector = Projector(args, spatial_merge_size, args.text.rms_norm_eps)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        # Mistral3Config's defaults: no projector biases, 2x2 merging.
        config = {"multimodal_projector_bias": False, **config}
        return cls(cls.model_args(config), config.get("spatial_merge_size", 2))

    def project(self, per_image, image_sizes):
        patch = self.args.vision.patch_size
        return [
            self.multi_modal_projector(features, (int(h) // patch, int(w) // patch))
            for features, (h, w) in zip(per_image, np.asarray(image_sizes).tolist())
        ]


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
