"""PaddleOCR-VL's vision tower: a NaViT-style SigLIP encoder over native-resolution
patches, and the projector that folds each 2x2 block of patch features into one token of
the text model's width.

What it shares and what differs:

- Blocks: SigLIP's (``layer_norm1``, ``self_attn``, ``layer_norm2``, ``mlp.fc1/fc2``,
  ``layers/vit.py``'s MLP), with q/k/v fused into ``self_attn.qkv`` as mlx-community
  stores them, and a 2-D rotary embedding on queries and keys: the Qwen-ViT's
  (``layers/qwen_vision.py``: rows' frequencies, then columns', over the whole head),
  with patches in plain raster order, since merging happens after the encoder.
- Attention never crosses an image (one segment per image, as Qwen-ViT's frames).
- Positions: SigLIP's learned square table, resampled to every image's patch grid by
  bilinear interpolation with half-pixel centres (torch's ``align_corners=False``).
- Patches arrive from the processor as (N, C, P, P); the patch convolution (kernel =
  stride) is one matmul per patch.
- Projector (``projector.*``, transformers' ``PaddleOCRProjector``, the Hub's
  ``mlp_AR``): LayerNorm per patch, each 2x2 block's patches concatenated
  (row-major within the block), Linear -> exact GELU -> Linear.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import run_ahead
from mlxvlm.models.config_utils import rope_parameters, with_defaults
from mlxvlm.models.layers import qwen_vision
from mlxvlm.models.layers.activations import activation
from mlxvlm.models.layers.qwen_vision import (
    VisionRotaryEmbedding,
    bilinear_position_taps,
    frame_segments,
    grids_thw,
    patch_rows_cols,
)
from mlxvlm.models.layers.siglip import VisionEmbeddings
from mlxvlm.models.layers.vit import MLP

# transformers' PaddleOCRVisionConfig defaults, for keys a checkpoint's config leaves out.
DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 384,
    "patch_size": 14,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "spatial_merge_size": 2,
}
# transformers' projector LayerNorm (not the config's layer_norm_eps).
PROJECTOR_NORM_EPS = 1e-5


@dataclass(frozen=True)
class NavitVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    spatial_merge_size: int
    rope_theta: float
    text_hidden_size: int  # the projector's output width

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, vision: dict, text_hidden_size: int) -> "NavitVisionConfig":
        """From a ``vision_config`` dict; missing keys take transformers' defaults."""
        values = with_defaults(vision, DEFAULTS)
        activation(values["hidden_act"])  # refuses an unsupported one when the config is read
        values["rope_theta"] = rope_parameters(vision, 10000.0)["rope_theta"]
        values["text_hidden_size"] = text_hidden_size
        return cls(**{f.name: values[f.name] for f in fields(cls)})


class PatchEmbeddings(VisionEmbeddings):
    """``embeddings.*``: SigLIP's patch convolution (in MLX's channels-last layout, as
    mlx-community stores it) and learned position table, applied to loose patches."""

    def __call__(self, patches: mx.array, grid_thw: np.ndarray) -> mx.array:
        """(N, C, P, P) patches of images with (t, h, w) grids -> (N, D)."""
        weight = self.patch_embedding.weight
        flat = patches.transpose(0, 2, 3, 1).reshape(patches.shape[0], -1).astype(weight.dtype)
        x = flat @ weight.reshape(weight.shape[0], -1).T + self.patch_embedding.bias
        indices, weights = bilinear_position_taps(
            grid_thw, 1, self.config.patches_per_side, align_corners=False
        )
        table = self.position_embedding(mx.array(indices))  # (N, 4, D)
        return x + (table * mx.array(weights)[:, :, None]).sum(axis=1).astype(x.dtype)


class Attention(qwen_vision.VisionAttention):
    """The Qwen-ViT's segment attention with 2-D rope, its output projection named
    ``out_proj`` as in SigLIP."""

    def __init__(self, config: NavitVisionConfig):
        super().__init__(config)
        self.out_proj = self.proj
        del self["proj"]

    def __call__(self, x: mx.array, rotary, segments) -> mx.array:
        return self.out_proj(self.attend(x, rotary, segments))


class EncoderLayer(nn.Module):
    def __init__(self, config: NavitVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def __call__(self, x: mx.array, rotary, segments) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x), rotary, segments)
        return self.mlp(self.layer_norm2(x), residual=x)


class Projector(nn.Module):
    def __init__(self, config: NavitVisionConfig):
        super().__init__()
        self.merge = config.spatial_merge_size
        merged = config.hidden_size * self.merge**2
        self.pre_norm = nn.LayerNorm(config.hidden_size, eps=PROJECTOR_NORM_EPS)
        self.linear_1 = nn.Linear(merged, merged)
        self.linear_2 = nn.Linear(merged, config.text_hidden_size)

    def __call__(self, x: mx.array, grid_thw: np.ndarray) -> mx.array:
        """Raster-ordered patch features of each image -> one token per 2x2 block."""
        m = self.merge
        x = self.pre_norm(x)
        blocks, start = [], 0
        for t, h, w in grid_thw.tolist():
            image = x[start : start + t * h * w].reshape(t, h // m, m, w // m, m, -1)
            blocks.append(image.transpose(0, 1, 3, 2, 4, 5).reshape(t * (h // m) * (w // m), -1))
            start += t * h * w
        merged = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0)
        return self.linear_2(nn.gelu(self.linear_1(merged)))


class NavitVisionModel(nn.Module):
    """``visual`` in mlx-community's checkpoints: ``embeddings``, ``layers``,
    ``post_layernorm`` and ``projector``."""

    def __init__(self, config: NavitVisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = PatchEmbeddings(config)
        self.layers = [EncoderLayer(config) for _ in range(config.num_hidden_layers)]
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.projector = Projector(config)
        self.rotary = VisionRotaryEmbedding(config.head_dim, config.rope_theta)

    def __call__(self, pixel_values: mx.array, grid_thw) -> mx.array:
        return self.encode(pixel_values, grid_thw)[0]

    def encode(self, pixel_values: mx.array, grid_thw) -> tuple[mx.array, list]:
        """(N, C, P, P) patches -> (N / merge^2, text width) tokens, and no DeepStack taps
        (the Qwen-VL families' ``encode`` contract)."""
        grid_thw = grids_thw(grid_thw)
        c, p = self.config.num_channels, self.config.patch_size
        x = self.embeddings(pixel_values.reshape(-1, c, p, p), grid_thw)
        rotary = self.rotary(mx.array(patch_rows_cols(grid_thw, 1)))
        segments = frame_segments(grid_thw)
        for layer in self.layers:
            x = layer(x, rotary, segments)
            run_ahead.layer_done(x)
        return self.projector(self.post_layernorm(x), grid_thw), []


def convert_hf_weight(name: str, value: mx.array) -> mx.array | None:
    """A tower tensor of a PyTorch checkpoint (``name`` relative to the tower, after
    renaming) in this module's layout; None for those transformers ignores too (the
    pooling head, the packing position table) and position-id buffers."""
    if name.startswith("head.") or "packing_position_embedding" in name or name.endswith("position_ids"):
        return None
    if name == "embeddings.patch_embedding.weight":
        return value.transpose(0, 2, 3, 1)  # PyTorch Conv2d (O, I, kh, kw) -> MLX (O, kh, kw, I)
    return value
