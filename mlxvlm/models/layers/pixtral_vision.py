"""Pixtral's vision transformer (Mistral AI, 2024), shared by Pixtral (LLaVA layout) and
Mistral 3.

Images keep their own size: each is cut into ``patch_size`` patches by a convolution,
normalized (RMSNorm), and run through transformer blocks with a 2-D rotary embedding —
half of each head's rotary frequencies turn with the patch's row, half with its column —
attending only within its own image. The blocks are pre-norm (RMSNorm) with a gated MLP.

Checkpoint names (mlx-community's): ``vision_tower.vision_model.{patch_conv, ln_pre,
transformer.layers.N.{attention.{q,k,v,o}_proj, attention_norm, feed_forward.{gate,up,
down}_proj, ffn_norm}}``; ``patch_conv.weight`` is stored (out, kh, kw, in).

For another family (e.g. LLaVA) to use the tower:

    tower = PixtralVisionTower(PixtralVisionConfig.from_hf(config["vision_config"]))
    per_image = tower(pixel_values, image_sizes, vision_feature_layer)  # list of (n_i, D)
    weights = {hf_vision_name_to_mlx(k): sanitize_vision_tensor(k, v) ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import run_ahead
from mlxvlm.models.config_utils import rope_parameters
from mlxvlm.models.layers.blocks import GatedMLP, LayerStack
from mlxvlm.cpu.ops import scaled_dot_product_attention
from mlxvlm.models.layers.qwen_vision import apply_rotary
from mlxvlm.models.weights import rename_prefix


@dataclass
class PixtralVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int = 3
    patch_size: int = 16
    hidden_act: str = "gelu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, vision: dict) -> "PixtralVisionConfig":
        """From ``vision_config`` in either layout (``rope_theta`` or ``rope_parameters``);
        defaults are transformers' PixtralVisionConfig's."""
        return cls(
            hidden_size=vision.get("hidden_size", 1024),
            intermediate_size=vision.get("intermediate_size", 4096),
            num_hidden_layers=vision.get("num_hidden_layers", 24),
            num_attention_heads=vision.get("num_attention_heads", 16),
            num_channels=vision.get("num_channels", 3),
            patch_size=vision.get("patch_size", 16),
            hidden_act=vision.get("hidden_act", "gelu"),
            rope_theta=rope_parameters(vision, 10000.0)["rope_theta"],
        )


class PixtralRotaryEmbedding:
    """cos/sin for (row, col) patch positions: of the head's rotary frequencies
    theta^(-2k/head_dim), the even-k ones turn with the row, the odd-k ones with the column."""

    def __init__(self, head_dim: int, theta: float):
        freqs = 1.0 / (theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim))
        self.row_freqs, self.col_freqs = freqs[0::2], freqs[1::2]
        # Constants: not left lazy on the loading thread's stream.
        mx.eval(self.row_freqs, self.col_freqs)

    def __call__(self, rows: mx.array, cols: mx.array) -> tuple[mx.array, mx.array]:
        rows, cols = rows.astype(mx.float32)[:, None], cols.astype(mx.float32)[:, None]
        angles = mx.concatenate([rows * self.row_freqs, cols * self.col_freqs], axis=-1)
        angles = mx.concatenate([angles, angles], axis=-1)
        return mx.cos(angles), mx.sin(angles)


class Attention(nn.Module):
    def __init__(self, config: PixtralVisionConfig):
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.scale = config.head_dim**-0.5
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def __call__(self, x: mx.array, rotary: tuple[mx.array, mx.array]) -> mx.array:
        """Full attention over one image's patches ``x`` (1, N, D)."""
        B, N, _ = x.shape
        q, k, v = (
            proj(x).reshape(B, N, self.num_heads, -1)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        # Rotated in the (B, N, heads, head_dim) layout (the tables broadcast over the
        # heads), then transposed: MLX's CPU element-wise products are ~3x faster there.
        cos, sin = (table[:, None] for table in rotary)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        out = scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, N, -1))




class TransformerLayer(nn.Module):
    def __init__(self, config: PixtralVisionConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=1e-5)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=1e-5)
        self.feed_forward = GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, bias=False
        )

    def __call__(self, x: mx.array, rotary) -> mx.array:
        x = x + self.attention(self.attention_norm(x), rotary)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVisionModel(nn.Module):
    def __init__(self, config: PixtralVisionConfig):
        super().__init__()
        self.config = config
        self.patch_conv = nn.Conv2d(
            config.num_channels,
            config.hidden_size,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=False,
        )
        self.ln_pre = nn.RMSNorm(config.hidden_size, eps=1e-5)
        self.transformer = LayerStack(lambda: TransformerLayer(config), config.num_hidden_layers)
        self.rotary = PixtralRotaryEmbedding(config.head_dim, config.rope_theta)

    def hidden_states(self, image: mx.array, last_layer: int) -> list[mx.array]:
        """One image (C, H, W), H and W multiples of the patch size -> hidden states
        [after ln_pre, after layer 1, ..., after layer ``last_layer``], each (h*w, D)."""
        patches = self.patch_conv(image.transpose(1, 2, 0)[None].astype(self.patch_conv.weight.dtype))
        _, h, w, dim = patches.shape
        x = self.ln_pre(patches.reshape(1, h * w, dim))
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        cos, sin = self.rotary(mx.array(rows.reshape(-1)), mx.array(cols.reshape(-1)))
        rotary = (cos.astype(x.dtype), sin.astype(x.dtype))
        states = [x[0]]
        for layer in self.transformer.layers[:last_layer]:
            x = layer(x, rotary)
            run_ahead.layer_done(x)
            states.append(x[0])
        return states


def _layer_indices(feature_layer: int | Sequence[int], num_layers: int) -> list[int]:
    """transformers' hidden-state indices (0 = after ln_pre, -1 = the last layer)."""
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    count = num_layers + 1
    if any(not -count <= i < count for i in layers):
        raise ValueError(f"vision_feature_layer {feature_layer} is out of range for {num_layers} layers")
    return [i % count for i in layers]


class PixtralVisionTower(nn.Module):
    """``vision_tower``: runs each image at its own size, returns its patch features."""

    def __init__(self, config: PixtralVisionConfig):
        super().__init__()
        self.config = config
        self.vision_model = PixtralVisionModel(config)

    def __call__(
        self,
        pixel_values: mx.array,
        image_sizes: Sequence[Sequence[int]],
        feature_layer: int | Sequence[int] = -1,
    ) -> list[mx.array]:
        """``pixel_values`` (B, C, H, W), padded to the batch's largest image, and each
        image's real (height, width) -> per image (h*w, D * len(feature layers)) features,
        patches in row-major order."""
        patch = self.config.patch_size
        layers = _layer_indices(feature_layer, self.config.num_hidden_layers)
        features = []
        for image, (height, width) in zip(pixel_values, np.asarray(image_sizes).tolist()):
            h, w = int(height) // patch, int(width) // patch
            states = self.vision_model.hidden_states(image[:, : h * patch, : w * patch], max(layers))
            selected = [states[i] for i in layers]
            features.append(selected[0] if len(selected) == 1 else mx.concatenate(selected, -1))
        return features


def hf_vision_name_to_mlx(name: str) -> str:
    """A Pixtral tower tensor's name under ``vision_tower.`` in a Hugging Face checkpoint
    (``vision_tower.X`` or, transformers 5, ``model.vision_tower.X``) -> ours."""
    return rename_prefix(name, (("model.vision_tower.", "vision_tower.vision_model."),
                                ("vision_tower.", "vision_tower.vision_model.")))


def sanitize_vision_tensor(name: str, value: mx.array) -> mx.array:
    """PyTorch Conv2d (out, in, kh, kw) -> MLX (out, kh, kw, in) for ``patch_conv``."""
    if name.endswith("patch_conv.weight"):
        return value.transpose(0, 2, 3, 1)
    return value
