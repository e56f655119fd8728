"""Gemma 4's vision encoder: a ViT over the processor's flattened patches (each image
resized to a patch budget, its aspect ratio kept, and padded to the budget), with

- learned x and y position embeddings added to a linear patch projection,
- bidirectional attention over the real patches with q/k RMS norms, a scale-free v norm
  and a 2-D rope (x on the first half of each head, y on the second),
- gated-GELU MLPs, four RMS norms per block (Gemma's sandwich), optionally clipped linears
  (bounds stored in the checkpoint),
- a pooler that averages ``k x k`` patch windows (by position) into soft tokens and
  scales them by sqrt(hidden_size), then optional standardization.

Names are transformers' (``patch_embedder.*``, ``encoder.layers.N.*``, ``std_bias``), which
are also mlx-community's under ``vision_tower.``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.cpu.ops import gated, gelu_tanh, scaled_dot_product_attention
from mlxvlm.models.layers.blocks import LayerStack
from mlxvlm.models.config_utils import with_defaults

gelu_glu = gated(gelu_tanh)

# transformers' Gemma4VisionConfig defaults
VISION_DEFAULTS = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
    num_key_value_heads=12, head_dim=64, rms_norm_eps=1e-6, pooling_kernel_size=3,
    patch_size=16, position_embedding_size=10 * 1024, use_clipped_linears=False,
    standardize=False, rope_theta=100.0, hidden_activation="gelu_pytorch_tanh",
)


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    pooling_kernel_size: int
    patch_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool
    rope_theta: float
    hidden_activation: str

    @classmethod
    def from_hf(cls, vision: dict) -> "VisionConfig":
        values = with_defaults(vision, VISION_DEFAULTS)
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise NotImplementedError(f"Gemma 4 vision rope {rope['rope_type']!r} is not supported")
        values["rope_theta"] = float(rope.get("rope_theta", vision.get("rope_theta", 100.0)))
        if values["hidden_activation"] != "gelu_pytorch_tanh":
            raise NotImplementedError(
                f"Gemma 4 vision activation {values['hidden_activation']!r} is not supported"
            )
        return cls(**values)


class ClippableLinear(nn.Module):
    """A bias-free linear layer whose input and output may be clamped to bounds the
    checkpoint stores (``input_min`` ... ``output_max``)."""

    def __init__(self, in_features: int, out_features: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        if clipped:
            self.input_min = mx.array(-float("inf"))
            self.input_max = mx.array(float("inf"))
            self.output_min = mx.array(-float("inf"))
            self.output_max = mx.array(float("inf"))
        self.clipped = clipped

    def __call__(self, x: mx.array) -> mx.array:
        if not self.clipped:
            return self.linear(x)
        x = mx.clip(x, self.input_min, self.input_max)
        return mx.clip(self.linear(x), self.output_min, self.output_max)


def rms_norm_no_scale(x: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, None, eps)


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def axial_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """``x``: (B, N, heads, head_dim); ``cos``/``sin``: (B, N, 2, head_dim / 2), the x
    angles for the first half of each head, the y angles for the second."""
    half = x.shape[-1] // 2
    parts = []
    for axis in range(2):
        part = x[..., axis * half : (axis + 1) * half]
        c, s = cos[:, :, None, axis], sin[:, :, None, axis]
        parts.append(part * c + rotate_half(part) * s)
    return mx.concatenate(parts, axis=-1)


def axial_angles(positions: mx.array, head_dim: int, theta: float) -> tuple[mx.array, mx.array]:
    """cos and sin, (B, N, 2, head_dim / 2), of the (x, y) patch positions."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (mx.arange(0, spatial, 2, dtype=mx.float32) / spatial))
    freqs = positions.astype(mx.float32)[..., None] * inv_freq  # (B, N, 2, spatial / 2)
    freqs = mx.concatenate([freqs, freqs], axis=-1)
    return mx.cos(freqs), mx.sin(freqs)


class Attention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        clipped, hidden = config.use_clipped_linears, config.hidden_size
        self.q_proj = ClippableLinear(hidden, self.heads * self.head_dim, clipped)
        self.k_proj = ClippableLinear(hidden, self.kv_heads * self.head_dim, clipped)
        self.v_proj = ClippableLinear(hidden, self.kv_heads * self.head_dim, clipped)
        self.o_proj = ClippableLinear(self.heads * self.head_dim, hidden, clipped)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array) -> mx.array:
        B, N, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, N, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(B, N, self.kv_heads, self.head_dim))
        v = rms_norm_no_scale(self.v_proj(x).reshape(B, N, self.kv_heads, self.head_dim), self.eps)
        q = axial_rope(q, cos, sin).transpose(0, 2, 1, 3)
        k = axial_rope(k, cos, sin).transpose(0, 2, 1, 3)
        out = scaled_dot_product_attention(q, k, v.transpose(0, 2, 1, 3), scale=1.0, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, N, -1))


class MLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        clipped = config.use_clipped_linears
        self.gate_proj = ClippableLinear(config.hidden_size, config.intermediate_size, clipped)
        self.up_proj = ClippableLinear(config.hidden_size, config.intermediate_size, clipped)
        self.down_proj = ClippableLinear(config.intermediate_size, config.hidden_size, clipped)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gelu_glu(self.gate_proj(x), self.up_proj(x)))


class EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, x, cos, sin, mask):
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class PatchEmbedder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, bias=False)
        self.position_embedding_table = mx.ones(
            (2, config.position_embedding_size, config.hidden_size)
        )

    def __call__(self, pixels: mx.array, positions: mx.array, padding: mx.array) -> mx.array:
        # Pixels arrive in [0, 1]; the model, not the processor, maps them to [-1, 1].
        h = self.input_proj((2 * (pixels - 0.5)).astype(self.input_proj.weight.dtype))
        clamped = mx.maximum(positions, 0)
        table = self.position_embedding_table
        pos = table[0][clamped[..., 0]] + table[1][clamped[..., 1]]
        return h + mx.where(padding[..., None], 0.0, pos).astype(h.dtype)


def pooling_plan(positions: np.ndarray, num_patches: int, kernel: int):
    """For each image's (x, y) patch positions (-1: padding): the soft token each patch
    averages into, and the soft tokens that are real. Soft tokens are numbered row-major
    over the ``kernel x kernel`` windows, as transformers' pooler numbers them."""
    length = num_patches // kernel**2
    clamped = np.maximum(positions, 0)
    width = clamped[..., 0].max(axis=-1, keepdims=True) + 1
    windows = clamped // kernel
    token = windows[..., 0] + (width // kernel) * windows[..., 1]  # (B, N)
    used = np.zeros((positions.shape[0], length), dtype=bool)
    np.put_along_axis(used, token, True, axis=-1)
    return token, used


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = LayerStack(lambda: EncoderLayer(config), config.num_hidden_layers)
        if config.standardize:
            self.std_bias = mx.zeros((config.hidden_size,))
            self.std_scale = mx.ones((config.hidden_size,))

    def __call__(self, pixel_values: mx.array, positions: np.ndarray) -> mx.array:
        """Soft tokens of every image, concatenated in order: (total tokens, hidden), from
        the processor's patches (B, max_patches, 3 * patch**2) and positions (B, max_patches, 2)."""
        config = self.config
        positions = np.asarray(positions)
        padding = (positions == -1).all(axis=-1)
        positions_mx, padding_mx = mx.array(positions), mx.array(padding)
        h = self.patch_embedder(pixel_values, positions_mx, padding_mx)
        cos, sin = axial_angles(positions_mx, config.head_dim, config.rope_theta)
        cos, sin = cos.astype(h.dtype), sin.astype(h.dtype)
        # keys of padding patches are never attended to
        mask = ~padding_mx[:, None, None, :]
        for layer in self.encoder.layers:
            h = layer(h, cos, sin, mask)
        h = mx.where(padding_mx[..., None], 0.0, h)

        kernel, N = config.pooling_kernel_size, pixel_values.shape[1]
        token, used = pooling_plan(positions, N, kernel)
        length = N // kernel**2
        weights = (mx.array(token)[..., None] == mx.arange(length)).astype(mx.float32) / kernel**2
        pooled = weights.transpose(0, 2, 1) @ h.astype(mx.float32)  # (B, length, hidden)
        pooled = pooled.astype(h.dtype).astype(mx.float32) * config.hidden_size**0.5
        rows = np.flatnonzero(used.reshape(-1))
        tokens = pooled.reshape(-1, pooled.shape[-1])[mx.array(rows)]
        if config.standardize:
            tokens = (tokens - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return tokens.astype(h.dtype)
