"""The SigLIP 2 NaFlex vision encoder (Tschannen et al., 2025): SigLIP's ViT at a variable
resolution. The processor cuts each image, at its own aspect ratio, into ``patch_size``
patches and flattens them (``(patches, p * p * C)``, row by row, padded to a fixed
count); a linear layer embeds a patch, and the learned square grid of position
embeddings is resized to the image's ``rows x columns`` patch grid (antialiased bilinear,
as ``F.interpolate`` does it) before it is added.

transformers' ``Siglip2VisionModel``; checkpoint names (mlx-community's):
``embeddings.patch_embedding`` (a Linear), ``embeddings.position_embedding``,
``encoder.layers.N.*`` (SigLIP's blocks, layers/vit.py) and ``post_layernorm``.

Each image runs on its own real patches only: padding patches are masked out of
attention in transformers, so dropping them gives the same features for the real ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import run_ahead
from mlxvlm.models.layers.activations import activation
from mlxvlm.models.layers.siglip import SIGLIP_DEFAULTS
from mlxvlm.models.layers.vit import Encoder, VitConfig
from mlxvlm.models.config_utils import with_defaults


@dataclass(frozen=True)
class Siglip2VisionConfig(VitConfig):
    """``image_size`` is the side of the position grid in pixels (``patch_size`` times
    the side of ``num_patches``' square): NaFlex checkpoints give ``num_patches`` instead."""

    num_patches: int = 256

    @classmethod
    def from_hf(cls, vision: dict) -> "Siglip2VisionConfig":
        values = with_defaults(vision, SIGLIP_DEFAULTS)
        values["num_patches"] = vision.get("num_patches", 256)
        side = math.isqrt(values["num_patches"])
        if side * side != values["num_patches"]:
            raise ValueError(f"num_patches {values['num_patches']} is not a square grid")
        values["image_size"] = side * values["patch_size"]
        activation(values["hidden_act"])  # refuses an unsupported one when the config is read
        return cls(**{f.name: values[f.name] for f in fields(cls)})


def position_weights(grid: int, rows: int, columns: int) -> np.ndarray:
    """(rows * columns, grid * grid) float32: each output position as a weighted sum of the
    ``grid x grid`` learned positions, the weights of an antialiased bilinear resize
    (``align_corners=False``) along each axis, in transformers' float32 arithmetic."""

    def axis(size: int) -> np.ndarray:  # (size, grid), rows summing to one
        scale = np.float32(grid) / np.float32(size)
        support = max(scale, np.float32(1.0))
        center = (np.arange(size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
        source = np.arange(grid, dtype=np.float32)
        w = np.maximum(1 - np.abs(source[None, :] - center[:, None]) / support, 0).astype(np.float32)
        return (w / w.sum(-1, keepdims=True)).astype(np.float32)

    row, column = axis(rows), axis(columns)
    return (row[:, None, :, None] * column[None, :, None, :]).reshape(rows * columns, grid * grid)


class NaflexEmbeddings(nn.Module):
    def __init__(self, config: Siglip2VisionConfig):
        super().__init__()
        self.config = config
        patch_width = config.num_channels * config.patch_size**2
        self.patch_embedding = nn.Linear(patch_width, config.hidden_size)
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)

    def __call__(self, patches: mx.array, rows: int, columns: int) -> mx.array:
        """``patches``: (1, rows * columns, p * p * C), the image's real patches."""
        grid = self.config.patches_per_side
        weights = mx.array(position_weights(grid, rows, columns))
        table = self.position_embedding.weight
        positions = (weights @ table.astype(mx.float32)).astype(table.dtype)
        return self.patch_embedding(patches) + positions


class Siglip2VisionModel(nn.Module):
    """Embeddings, SigLIP's encoder blocks and the final LayerNorm (no pooling head: the
    vision-language models use the patch features)."""

    def __init__(self, config: Siglip2VisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = NaflexEmbeddings(config)
        self.encoder = Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, patches: mx.array, rows: int, columns: int) -> mx.array:
        """(1, rows * columns, D) features of one image's ``rows x columns`` patches
        (1, rows * columns, p * p * C)."""
        h = self.embeddings(patches, rows, columns)
        for layer in self.encoder.layers:
            h = layer(h)
            run_ahead.layer_done(h)
        return self.post_layernorm(h)


def convert_hf_weight(name: str, value: mx.array) -> mx.array | None:
    """A tensor of a PyTorch checkpoint (``name`` relative to the tower) in this module's
    layout (the same: the patch embedding is a linear layer); None for what this port
    does not build (position-id buffers, the pooling head)."""
    if name.endswith("position_ids") or name.startswith("head."):
        return None
    return value
