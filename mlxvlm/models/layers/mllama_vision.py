"""Llama 3.2 Vision's tiled vision encoder (transformers' ``MllamaVisionModel``).

An image comes as up to ``max_num_tiles`` square tiles and an aspect-ratio id (which
tile layout it was cut into). Each tile is cut into patches plus a class token; learned
embeddings of the layout are added before the encoder (``pre_tile_positional_embedding``,
per tile) and, gated, per position and tile (``gated_positional_embedding``); a local
encoder runs over all of an image's tiles together, then the layout's embedding again
(``post_tile_positional_embedding``) and a gated global encoder. The output of each
position is the global encoder's state concatenated with the local encoder's states
after ``intermediate_layers_indices`` (the multi-layer features).

Positions are padded to a multiple of 8 inside the encoders, and padding -- the padded
positions of every tile, and whole tiles the image does not use -- is masked as
transformers masks it: a query and a key are kept apart only when *both* are padding
(``_prepare_aspect_ratio_attention_mask`` builds the outer product of the padding flags).

Module names are the checkpoints' (``transformer.layers.N.self_attn.q_proj``,
``global_transformer.layers.N.gate_attn`` ...), under ``vision_tower.`` in ours (mlx-community's).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.cpu.ops import scaled_dot_product_attention
from mlxvlm.models import run_ahead
from mlxvlm.models.layers.activations import activation

PAD_TO = 8  # positions per tile are padded to a multiple of this


@dataclass(frozen=True)
class MllamaVisionConfig:
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_global_layers: int = 8
    attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 448
    patch_size: int = 14
    norm_eps: float = 1e-5
    max_num_tiles: int = 4
    hidden_act: str = "gelu"
    intermediate_layers_indices: tuple[int, ...] = (3, 7, 15, 23, 30)
    supported_aspect_ratios: tuple[tuple[int, int], ...] = (
        (1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1))
    vision_output_dim: int = 7680

    @classmethod
    def from_hf(cls, vision: dict) -> "MllamaVisionConfig":
        values = {k: v for k, v in vision.items() if k in cls.__dataclass_fields__}
        if "num_attention_heads" in vision and "attention_heads" not in vision:
            values["attention_heads"] = vision["num_attention_heads"]
        for key in ("intermediate_layers_indices", "supported_aspect_ratios"):
            if values.get(key) is not None:
                values[key] = tuple(tuple(v) if isinstance(v, list) else v for v in values[key])
            else:
                values.pop(key, None)
        return cls(**values)

    @property
    def num_patches(self) -> int:
        """Positions per tile: the patches and the class token."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def max_aspect_ratio_id(self) -> int:
        return len(self.supported_aspect_ratios)


class VisionAttention(nn.Module):
    def __init__(self, config: MllamaVisionConfig):
        super().__init__()
        dims = config.hidden_size
        self.num_heads = config.attention_heads
        self.scale = (dims // self.num_heads) ** -0.5
        self.q_proj = nn.Linear(dims, dims, bias=False)
        self.k_proj = nn.Linear(dims, dims, bias=False)
        self.v_proj = nn.Linear(dims, dims, bias=False)
        self.o_proj = nn.Linear(dims, dims, bias=False)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        B, L, _ = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)

        out = scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                           heads(self.v_proj(x)), scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: MllamaVisionConfig):
        super().__init__()
        self.activation = activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.activation(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """A pre-norm block; the global encoder's scale each branch by tanh of a gate."""

    def __init__(self, config: MllamaVisionConfig, gated: bool):
        super().__init__()
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.gated = gated
        if gated:
            self.gate_attn = mx.zeros((1,))
            self.gate_ffn = mx.zeros((1,))

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        h = self.self_attn(self.input_layernorm(x), mask)
        x = x + (mx.tanh(self.gate_attn) * h if self.gated else h)
        run_ahead.layer_done(x)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (mx.tanh(self.gate_ffn) * h if self.gated else h)


class VisionEncoder(nn.Module):
    def __init__(self, config: MllamaVisionConfig, num_layers: int, gated: bool):
        super().__init__()
        self.layers = [VisionEncoderLayer(config, gated) for _ in range(num_layers)]


class AspectRatioEmbedding(nn.Module):
    """One learned vector per tile of each tile layout, gated, added to all its positions."""

    def __init__(self, config: MllamaVisionConfig):
        super().__init__()
        self.max_num_tiles = config.max_num_tiles
        self.embedding = nn.Embedding(config.max_aspect_ratio_id + 1,
                                      config.max_num_tiles * config.hidden_size)
        self.gate = mx.zeros((1,))

    def __call__(self, x: mx.array, aspect_ratio_ids: mx.array) -> mx.array:
        # x: (images, tiles, positions, width)
        embeddings = self.embedding(aspect_ratio_ids).reshape(-1, self.max_num_tiles, 1, x.shape[-1])
        return x + mx.tanh(self.gate) * embeddings


class PositionEmbedding(nn.Module):
    """A learned embedding per position (weighted 1 - tanh(gate)) and one per position of
    each tile of each layout (weighted tanh(gate))."""

    def __init__(self, config: MllamaVisionConfig):
        super().__init__()
        self.max_num_tiles = config.max_num_tiles
        self.num_patches = config.num_patches
        self.gate = mx.zeros((1,))
        self.embedding = mx.zeros((config.num_patches, config.hidden_size))
        self.tile_embedding = nn.Embedding(
            config.max_aspect_ratio_id + 1,
            config.max_num_tiles * config.num_patches * config.hidden_size)

    def __call__(self, x: mx.array, aspect_ratio_ids: mx.array) -> mx.array:
        gate = mx.tanh(self.gate)
        x = x + (1 - gate) * self.embedding
        tiles = self.tile_embedding(aspect_ratio_ids).reshape(
            x.shape[0], self.max_num_tiles, self.num_patches, x.shape[-1])
        return x + gate * tiles


def padding_attention_mask(aspect_ratio_mask: np.ndarray, num_patches: int,
                           padded_patches: int) -> mx.array:
    """(images, 1, N, N) bool, N = tiles x padded positions: True where a query may attend
    to a key, i.e. unless both are padding (a tile the image does not use, or a position
    past a tile's ``num_patches``). transformers marks the padded positions with
    ``[-pad:]``, which with no padding at all marks every position: kept as it is."""
    pad = padded_patches - num_patches
    patch_is_pad = np.zeros(padded_patches, dtype=bool)
    patch_is_pad[-pad:] = True  # (every position when pad is 0, as transformers' slice)
    tile_is_pad = np.asarray(aspect_ratio_mask) == 0  # (images, tiles)
    is_pad = (tile_is_pad[:, :, None] | patch_is_pad[None, None, :]).reshape(len(tile_is_pad), -1)
    return mx.array(~(is_pad[:, :, None] & is_pad[:, None, :]))[:, None]


class MllamaVisionModel(nn.Module):
    def __init__(self, config: MllamaVisionConfig):
        super().__init__()
        self.config = config
        width = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, width, config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.class_embedding = mx.zeros((width,))
        self.gated_positional_embedding = PositionEmbedding(config)
        self.pre_tile_positional_embedding = AspectRatioEmbedding(config)
        self.post_tile_positional_embedding = AspectRatioEmbedding(config)
        self.layernorm_pre = nn.LayerNorm(width)
        self.layernorm_post = nn.LayerNorm(width)
        self.transformer = VisionEncoder(config, config.num_hidden_layers, gated=False)
        self.global_transformer = VisionEncoder(config, config.num_global_layers, gated=True)

    @staticmethod
    def convert_hf_weight(name: str, value: mx.array) -> mx.array:
        """PyTorch's (out, in, kh, kw) patch convolution as MLX's (out, kh, kw, in)."""
        if name == "patch_embedding.weight" and value.ndim == 4:
            return value.transpose(0, 2, 3, 1)
        return value

    def __call__(self, pixel_values: mx.array, aspect_ratio_ids: mx.array,
                 aspect_ratio_mask: np.ndarray) -> mx.array:
        """(images, tiles, C, H, W) pixels, (images,) layout ids, (images, tiles) tile
        mask -> (images, tiles, num_patches, vision_output_dim) features."""
        config = self.config
        images, tiles = pixel_values.shape[:2]
        width = config.hidden_size
        pixels = pixel_values.reshape(images * tiles, *pixel_values.shape[2:]).transpose(0, 2, 3, 1)
        x = self.patch_embedding(pixels.astype(self.class_embedding.dtype))
        x = x.reshape(images, tiles, -1, width)
        x = self.pre_tile_positional_embedding(x, aspect_ratio_ids)
        cls = mx.broadcast_to(self.class_embedding, (images, tiles, 1, width)).astype(x.dtype)
        x = mx.concatenate([cls, x], axis=2)
        x = self.layernorm_pre(self.gated_positional_embedding(x, aspect_ratio_ids))

        positions = config.num_patches
        padded = positions + (-positions) % PAD_TO
        x = mx.pad(x, [(0, 0), (0, 0), (0, padded - positions), (0, 0)])
        mask = padding_attention_mask(aspect_ratio_mask, positions, padded)

        x = x.reshape(images, tiles * padded, width)
        taps = set(config.intermediate_layers_indices)
        tapped = {}
        for index, layer in enumerate(self.transformer.layers):
            x = layer(x, mask)
            if index in taps:
                tapped[index] = x
        x = self.layernorm_post(x)
        x = self.post_tile_positional_embedding(x.reshape(images, tiles, padded, width),
                                                aspect_ratio_ids)
        x = x.reshape(images, tiles * padded, width)
        for layer in self.global_transformer.layers:
            x = layer(x, mask)
        features = [x] + [tapped[i] for i in config.intermediate_layers_indices]
        # transformers stacks the taps on a last axis and flattens it: width-major.
        intermediate = mx.stack(features[1:], axis=-1).reshape(images, tiles * padded, -1)
        out = mx.concatenate([features[0], intermediate], axis=-1)
        return out.reshape(images, tiles, padded, -1)[:, :, :positions]
