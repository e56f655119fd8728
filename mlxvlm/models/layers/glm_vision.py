"""The GLM-V vision tower (GLM-4.1V, GLM-4.5V, GLM-4.6V; GLM-OCR's by its switches).

Patches arrive as the Qwen towers take them (``channels x temporal_patch_size x patch x
patch`` values, each merge block's patches contiguous) and the 2-D rotary embedding is
the Qwen towers' (row angles, then column angles, over the whole head), so the patch
embedding, the rotary tables, the per-frame attention and the patch order come from
``qwen_vision``. What is GLM's own:

- after the patch embedding an RMSNorm, then a learned 24 x 24 position table
  *bicubically* resampled to each image's patch grid (torch's ``grid_sample`` with
  half-pixel centres and the border repeated), so any aspect ratio gets its own table;
- RMSNorm blocks whose gated MLP is as wide as the tower's *output* (``out_hidden_size``);
- the merge: a 2 x 2 convolution (``downsample``) folds each merge block into one token of
  the text width, then a projector (``proj``, LayerNorm, GELU, then a SiLU-gated MLP of
  ``intermediate_size``).

GLM-OCR is the same tower without the position table and its norm
(``learned_positions=False``), with biases on every attention and MLP projection
(``projection_biases``), per-head RMSNorm on queries and keys (``qk_norm``), its block MLP
``intermediate_size`` wide and its projector's ``out_hidden_size * in_channels``
(``mlp_width``, ``merger_width``).

Checkpoint names (mlx-community's): ``patch_embed.proj``, ``post_conv_layernorm``,
``embeddings.position_embedding``, ``blocks.N.{norm1,norm2,attn.qkv,attn.proj,
mlp.gate_proj,mlp.up_proj,mlp.down_proj}``, ``post_layernorm``, ``downsample``,
``merger.{proj,post_projection_norm,gate_proj,up_proj,down_proj}``; the convolutions
channels last.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import run_ahead
from mlxvlm.models.config_utils import rope_parameters
from mlxvlm.models.layers.activations import activation
from mlxvlm.models.layers.blocks import GatedMLP
from mlxvlm.models.layers.qwen_vision import (
    PatchEmbed,
    VisionAttention,
    VisionRotaryEmbedding,
    frame_segments,
    grids_thw,
    patch_rows_cols,
)

# torch's bicubic convolution coefficient (grid_sample, interpolate)
CUBIC_A = -0.75


@dataclass
class GlmVisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    out_hidden_size: int  # the text model's width
    intermediate_size: int  # the projector's gated MLP
    image_size: int = 336
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False  # on the qkv projection
    # GLM-OCR's switches (defaults: GLM-V's)
    projection_biases: bool = False  # attention_bias on the attention output and MLP too
    learned_positions: bool = True
    qk_norm: bool = False
    mlp_width: int | None = None  # block MLP; None: out_hidden_size
    merger_width: int | None = None  # projector MLP; None: intermediate_size
    patch_bias: bool = True  # read by qwen_vision.PatchEmbed

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, vision: dict, **switches) -> "GlmVisionConfig":
        """transformers' Glm4vVisionConfig fields (its defaults where a key is missing);
        ``switches`` override them (GLM-OCR's)."""
        fields = dict(
            depth=vision.get("depth", 24),
            hidden_size=vision.get("hidden_size", 1536),
            num_heads=vision.get("num_heads", 12),
            out_hidden_size=vision.get("out_hidden_size", 4096),
            intermediate_size=vision.get("intermediate_size", 13696),
            image_size=_side(vision.get("image_size", 336)),
            patch_size=_side(vision.get("patch_size", 14)),
            temporal_patch_size=_side(vision.get("temporal_patch_size", 2)),
            in_channels=vision.get("in_channels", 3),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            hidden_act=vision.get("hidden_act", "silu"),
            rms_norm_eps=vision.get("rms_norm_eps", 1e-5),
            rope_theta=rope_parameters(vision, 10000.0)["rope_theta"],
            attention_bias=bool(vision.get("attention_bias", False)),
        )
        return cls(**{**fields, **switches})


def _side(value) -> int:
    """transformers allows ``image_size``/``patch_size`` as [h, w]; GLM's are square."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise NotImplementedError(f"non-square vision sizes {list(value)} are not supported")
        return int(value[0])
    return int(value)


def convert_hf_weight(name: str, value: mx.array) -> mx.array:
    """A Hugging Face tensor of the tower (``name`` relative to it) in our layout: the
    PyTorch convolutions channels last (Conv3d (out, in, t, h, w) -> (out, t, h, w, in),
    Conv2d (out, in, h, w) -> (out, h, w, in))."""
    if name == "patch_embed.proj.weight" and value.ndim == 5:
        return value.transpose(0, 2, 3, 4, 1)
    if name == "downsample.weight" and value.ndim == 4:
        return value.transpose(0, 2, 3, 1)
    return value


# -- the position table, resampled -----------------------------------------------------


def _cubic_weights(t: np.ndarray) -> np.ndarray:
    """(n,) fractions -> (n, 4) weights of the taps at -1, 0, +1, +2 (torch's
    ``get_cubic_upsample_coefficients``), in float32 as torch computes them."""
    a = np.float32(CUBIC_A)
    t = t.astype(np.float32)

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1).astype(np.float32)


@lru_cache(maxsize=64)
def _grid_taps(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    grid = np.array([[1, h, w]])
    rows_cols = patch_rows_cols(grid, merge).astype(np.float32)
    sizes = np.array([h, w], dtype=np.float32)
    # grid_sample's coordinate: normalized ((i + 0.5) / size) * 2 - 1, then unnormalized
    # without aligned corners: ((x + 1) * side - 1) / 2.
    normalized = ((rows_cols + np.float32(0.5)) / sizes) * np.float32(2) - np.float32(1)
    source = ((normalized + np.float32(1)) * np.float32(side) - np.float32(1)) / np.float32(2)
    base = np.floor(source)
    weights = _cubic_weights((source - base).reshape(-1)).reshape(-1, 2, 4)  # (N, axis, tap)
    taps = np.clip(base.astype(np.int64)[:, :, None] + np.arange(-1, 3), 0, side - 1)
    rows, cols = taps[:, 0], taps[:, 1]  # (N, 4) each
    indices = (rows[:, :, None] * side + cols[:, None, :]).reshape(-1, 16)
    products = (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 16)
    return indices, products.astype(np.float32)


def bicubic_position_taps(grid_thw: np.ndarray, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Per patch (processor order): the 16 cells of a ``side`` x ``side`` position table
    and their weights that resample it bicubically to the image's patch grid, as torch's
    ``grid_sample(mode="bicubic", align_corners=False, padding_mode="border")`` does.
    Returns (N, 16) indices and (N, 16) float32 weights."""
    parts = [_grid_taps(h, w, merge, side) for t, h, w in grid_thw.tolist() for _ in range(t)]
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


class PositionEmbeddings(nn.Module):
    """``embeddings`` in checkpoints: the learned table, resampled per image."""

    def __init__(self, config: GlmVisionConfig):
        super().__init__()
        self.side = config.position_side
        self.position_embedding = nn.Embedding(self.side * self.side, config.hidden_size)

    def __call__(self, x: mx.array, grid_thw: np.ndarray, merge: int) -> mx.array:
        indices, weights = bicubic_position_taps(grid_thw, merge, self.side)
        # in float32, as the reference resamples the table
        table = self.position_embedding.weight.astype(mx.float32)[mx.array(indices)]
        resampled = (table * mx.array(weights)[:, :, None]).sum(axis=1)
        return x + resampled.astype(x.dtype)


# -- blocks ------------------------------------------------------------------------------


class GlmVisionAttention(VisionAttention):
    """Qwen's per-frame attention over the fused ``qkv``, with GLM's biases and (GLM-OCR)
    per-head RMSNorm on queries and keys before the rotary embedding."""

    def __init__(self, config: GlmVisionConfig):
        super().__init__(config, qkv_bias=config.attention_bias,
                         proj_bias=config.attention_bias and config.projection_biases)
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps)
            self.k_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps)


class GlmVisionBlock(nn.Module):
    def __init__(self, config: GlmVisionConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm2 = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = GlmVisionAttention(config)
        width = config.mlp_width or config.out_hidden_size
        self.mlp = GatedMLP(config.hidden_size, width, config.hidden_act,
                            bias=config.attention_bias and config.projection_biases)

    def __call__(self, x: mx.array, rotary, segments: Sequence[int]) -> mx.array:
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class GlmPatchMerger(nn.Module):
    """``merger``: a projection, LayerNorm and GELU, then a SiLU-gated MLP."""

    def __init__(self, dim: int, width: int, hidden_act: str):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.up_proj = nn.Linear(dim, width, bias=False)
        self.down_proj = nn.Linear(width, dim, bias=False)
        self.act = activation(hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        x = nn.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class GlmVisionTransformer(nn.Module):
    """``vision_tower`` in checkpoints: pixels (N, C*T*P*P) and grids -> (N / merge^2, D_text)."""

    def __init__(self, config: GlmVisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        if config.learned_positions:
            self.post_conv_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.embeddings = PositionEmbeddings(config)
        self.blocks = [GlmVisionBlock(config) for _ in range(config.depth)]
        self.post_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        merge = config.spatial_merge_size
        self.downsample = nn.Conv2d(config.hidden_size, config.out_hidden_size,
                                    kernel_size=merge, stride=merge)
        self.merger = GlmPatchMerger(
            config.out_hidden_size, config.merger_width or config.intermediate_size,
            config.hidden_act,
        )
        self.rotary = VisionRotaryEmbedding(config.head_dim, config.rope_theta)

    def __call__(self, pixel_values: mx.array, grid_thw: np.ndarray) -> mx.array:
        return self.encode(pixel_values, grid_thw)[0]

    def encode(self, pixel_values: mx.array, grid_thw: np.ndarray) -> tuple[mx.array, list]:
        """The merged tokens (N / merge^2, D_text), and no DeepStack taps (the Qwen-VL
        tower interface)."""
        config = self.config
        grid_thw = grids_thw(grid_thw)
        merge = config.spatial_merge_size
        x = self.patch_embed(pixel_values)
        if config.learned_positions:
            x = self.embeddings(self.post_conv_layernorm(x), grid_thw, merge)
        rotary = self.rotary(mx.array(patch_rows_cols(grid_thw, merge)))
        segments = frame_segments(grid_thw)
        for block in self.blocks:
            x = block(x, rotary, segments)
            run_ahead.layer_done(x)
        x = self.post_layernorm(x)
        # each merge block's patches, row-major: one channels-last 2 x 2 image
        x = self.downsample(x.reshape(-1, merge, merge, x.shape[-1]))
        return self.merger(x.reshape(-1, config.out_hidden_size)), []
