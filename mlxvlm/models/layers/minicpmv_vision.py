"""MiniCPM-V 4.6's vision tower (transformers' ``MiniCPMV4_6VisionModel``): a SigLIP
encoder that takes each slice of a picture at its own patch grid, with a window-attention
merger inside it.

- Patches: a strided convolution; positions from a learned ``side x side`` table, each
  patch taking the entry nearest its fractional place in the grid (NaViT's buckets).
- Blocks: SigLIP's (``layers/vit.py``), attention within one slice.
- After block ``insert_layer_id`` (in the default ``"16x"`` mode), the window merger:
  attention inside each 2 x 2 window of patches, then each window's four patches,
  concatenated, through a LayerNorm + GELU MLP plus their mean: one token per window, so
  the later blocks see a grid halved on each side.
- ``post_layernorm`` at the end.

Module names follow transformers' (``embeddings.{patch_embedding,position_embedding}``,
``encoder.layers.N.*``, ``post_layernorm``); the window merger
(``{self_attn,layer_norm1,pre_norm,linear_1,linear_2}``) is the model's own module, as
mlx-community's conversions name it (``vit_merger.*`` beside the tower), and the tower
takes it as an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.cpu.ops import gelu_tanh
from mlxvlm.models import run_ahead
from mlxvlm.models.config_utils import with_defaults
from mlxvlm.models.layers.activations import activation
from mlxvlm.models.layers.vit import Attention, EncoderLayer

# transformers' MiniCPMV4_6VisionConfig defaults, for the fields this tower reads.
DEFAULTS = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6, insert_layer_id=6, window_kernel_size=(2, 2),
)


@dataclass(frozen=True)
class MiniCPMVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    insert_layer_id: int
    window: int  # the merger's window side

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, vision: dict, insert_layer_id: int) -> "MiniCPMVisionConfig":
        values = with_defaults(vision, DEFAULTS)
        for name in ("image_size", "patch_size"):
            value = values[name]
            if isinstance(value, (list, tuple)):
                if len(set(value)) != 1:
                    raise NotImplementedError(f"MiniCPM-V's tower with a non-square {name}")
                values[name] = value[0]
        window = tuple(values.pop("window_kernel_size"))
        if len(set(window)) != 1:
            raise NotImplementedError(f"MiniCPM-V's window merger with window {list(window)}")
        activation(values["hidden_act"])  # refuses an unsupported one now
        values["insert_layer_id"] = insert_layer_id  # the model's config sets the tower's
        return cls(**values, window=window[0])


def nearest_positions(rows: int, columns: int, side: int) -> np.ndarray:
    """The position-table index of each patch of a ``rows x columns`` grid, row by row:
    transformers' ``get_vision_nearest_position_ids`` (``torch.bucketize`` of ``i / rows``
    over the float32 boundaries ``arange(1 / side, 1, 1 / side)``)."""
    step = 1 / side
    count = math.ceil((1.0 - step) / step)
    boundaries = (step + np.arange(count) * step).astype(np.float32)

    def buckets(n: int) -> np.ndarray:
        coords = np.arange(n, dtype=np.float32) / np.float32(n)
        return np.searchsorted(boundaries, coords, side="right")

    return (buckets(rows)[:, None] * side + buckets(columns)[None, :]).reshape(-1)


class Embeddings(nn.Module):
    def __init__(self, config: MiniCPMVisionConfig):
        super().__init__()
        self.config = config
        # Weight in MLX's channels-last layout: (out, kh, kw, in).
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         config.patch_size, stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)

    def __call__(self, patches: mx.array, rows: int, columns: int) -> mx.array:
        """(patches, p, p, C) channels-last patch pixels of one slice -> (1, patches, D)."""
        x = self.patch_embedding(patches.astype(self.patch_embedding.weight.dtype))
        x = x.reshape(1, -1, x.shape[-1])
        ids = nearest_positions(rows, columns, self.config.patches_per_side)
        return x + self.position_embedding(mx.array(ids))


class WindowMerger(nn.Module):
    """One token per ``window x window`` square of patches (``vit_merger``)."""

    def __init__(self, config: MiniCPMVisionConfig):
        super().__init__()
        self.window = config.window
        width = config.hidden_size * config.window**2
        self.self_attn = Attention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.pre_norm = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.linear_1 = nn.Linear(width, config.intermediate_size * config.window**2)
        self.linear_2 = nn.Linear(config.intermediate_size * config.window**2, config.hidden_size)

    def windows(self, x: mx.array, rows: int, columns: int) -> mx.array:
        """(1, rows * columns, D) -> (windows, window², D): windows row by row, each one's
        patches row by row (transformers' ``get_vision_window_index`` order)."""
        w, D = self.window, x.shape[-1]
        return (x.reshape(rows // w, w, columns // w, w, D).transpose(0, 2, 1, 3, 4)
                .reshape(-1, w * w, D))

    def __call__(self, x: mx.array, rows: int, columns: int) -> mx.array:
        if rows % self.window or columns % self.window:
            raise ValueError(f"a {rows} x {columns} patch grid does not split into "
                             f"{self.window} x {self.window} windows")
        residual = self.windows(x, rows, columns)
        h = residual + self.self_attn(self.windows(self.layer_norm1(x), rows, columns))
        flat = h.reshape(h.shape[0], -1)
        merged = self.linear_2(gelu_tanh(self.linear_1(self.pre_norm(flat))))
        return (merged + h.mean(axis=1))[None]


class Encoder(nn.Module):
    def __init__(self, config: MiniCPMVisionConfig):
        super().__init__()
        self.layers = [EncoderLayer(config) for _ in range(config.num_hidden_layers)]


class MiniCPMVisionModel(nn.Module):
    def __init__(self, config: MiniCPMVisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, patches: mx.array, rows: int, columns: int,
                 window_merger: WindowMerger | None) -> tuple[mx.array, int, int]:
        """One slice's (patches, p, p, C) pixels on its ``rows x columns`` grid -> its
        (1, tokens, D) states and their grid (halved by ``window_merger``, which runs after
        block ``insert_layer_id``; None: the ``"4x"`` mode, without it)."""
        x = self.embeddings(patches, rows, columns)
        merge_after = self.config.insert_layer_id if window_merger is not None else -1
        for index, layer in enumerate(self.encoder.layers):
            x = layer(x)
            run_ahead.layer_done(x)
            if index == merge_after:
                x = window_merger(x, rows, columns)
                rows, columns = rows // self.config.window, columns // self.config.window
        return self.post_layernorm(x), rows, columns


def convert_hf_weight(name: str, value: mx.array) -> mx.array | None:
    """A tower tensor of a PyTorch checkpoint (``name`` relative to the tower) in this
    module's layout."""
    if name.endswith("position_ids"):
        return None
    if name == "embeddings.patch_embedding.weight":
        return value.transpose(0, 2, 3, 1)  # PyTorch Conv2d (O, I, kh, kw) -> MLX (O, kh, kw, I)
    return value
