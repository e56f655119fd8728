"""The Qwen vision transformer shared by Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

Images (and video frames) arrive from the processor already cut into flattened patches of
``channels x temporal_patch_size x patch x patch`` values, ordered so that each
``spatial_merge_size x spatial_merge_size`` block of neighbouring patches is contiguous.
The tower embeds each patch, runs transformer blocks with a 2-D rotary embedding (row and
column of the patch), and the merger folds every merge block into one token of the text
model's width.

The families differ only in parts selected by ``VisionConfig``:

=====================  ==================  ==========================  ====================
                       Qwen2-VL            Qwen2.5-VL                  Qwen3-VL
=====================  ==================  ==========================  ====================
norms (blocks, merger) LayerNorm           RMSNorm                     LayerNorm
block MLP              fc1 -> act -> fc2   SwiGLU: gate/up/down        linear_fc1 -> act ->
                                           (with biases)               linear_fc2
attention              full per frame      windows of ``window_size``  full per frame
                                           pixels, full in
                                           ``fullatt_block_indexes``
patch embedding        no bias             no bias                     bias, plus a learned
                                                                       position table
                                                                       resampled to the grid
merger names           ln_q, mlp.0, mlp.2  ln_q, mlp.0, mlp.2          norm, linear_fc1,
                                                                       linear_fc2
DeepStack              -                   -                           extra mergers after
                                                                       some blocks
=====================  ==================  ==========================  ====================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import run_ahead
from mlxvlm.models.config_utils import rope_parameters
from mlxvlm.models.layers import rotary as rotary_embedding
from mlxvlm.models.layers.activations import activation
from mlxvlm.models.layers.blocks import GatedMLP
from mlxvlm.cpu.ops import scaled_dot_product_attention


@dataclass
class VisionConfig:
    depth: int
    hidden_size: int  # width of the blocks (Qwen2-VL calls it embed_dim)
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # merger output: the text model's hidden size
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    hidden_act: str = "quick_gelu"
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    mlp: str = "fc"  # "fc" (fc1/fc2) | "gated" (gate_proj/up_proj/down_proj)
    window_size: int | None = None  # pixels per window side; None: full attention only
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    patch_bias: bool = False
    merger: str = "mlp"  # "mlp" (ln_q, mlp.0/mlp.2) | "linear_fc" (norm, linear_fc1/2)
    # Learned absolute positions on a square grid of this many cells, bilinearly resampled
    # to every image's patch grid (Qwen3-VL); None: rotary positions only.
    num_position_embeddings: int | None = None
    # Blocks after which an extra merger taps the hidden states (Qwen3-VL's DeepStack).
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, vision: dict, *, patch_size: int, hidden_act: str, **tower) -> "VisionConfig":
        """The settings every Qwen tower's ``vision_config`` spells alike, with the family's
        defaults for ``patch_size`` and ``hidden_act``; ``tower``: the family's switches,
        and its widths where they are not the config's own ``hidden_size``,
        ``intermediate_size`` and ``out_hidden_size`` (Qwen2-VL names them otherwise)."""
        for width in ("hidden_size", "intermediate_size", "out_hidden_size"):
            if width not in tower:
                tower[width] = vision[width]
        return cls(
            depth=vision["depth"],
            num_heads=vision["num_heads"],
            patch_size=vision.get("patch_size", patch_size),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            in_channels=vision.get("in_channels", 3),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            hidden_act=vision.get("hidden_act", hidden_act),
            rope_theta=rope_parameters(vision, 10000.0)["rope_theta"],
            **tower,
        )


def grids_thw(grid_thw) -> np.ndarray:
    """A processor's ``image_grid_thw`` / ``video_grid_thw`` (None: no images) as an
    (items, 3) int64 array of (t, h, w) patch grids."""
    if grid_thw is None:
        return np.zeros((0, 3), dtype=np.int64)
    return np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)


def convert_hf_weight(name: str, value: mx.array) -> mx.array:
    """A Hugging Face tensor of the tower (``name`` relative to it) in our layout: the
    patch embedding's PyTorch Conv3d (out, in, t, h, w) becomes MLX's (out, t, h, w, in)."""
    if name == "patch_embed.proj.weight":
        return value.transpose(0, 2, 3, 4, 1)
    return value


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=1e-6)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-6)
    raise ValueError(f"unknown vision norm {kind!r}")


class PatchEmbed(nn.Module):
    """Conv3d whose kernel equals its stride: one linear map per flattened patch."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.in_channels = config.in_channels
        # Weight in MLX's channels-last layout: (out, t, h, w, in).
        self.proj = nn.Conv3d(
            config.in_channels,
            config.hidden_size,
            self.kernel,
            stride=self.kernel,
            bias=config.patch_bias,
        )

    def __call__(self, pixel_values: mx.array) -> mx.array:
        # The processor flattens each patch channels-first (C, T, P, P); the kernel covers
        # the whole patch, so the convolution is a matmul over the channels-last patch.
        patches = pixel_values.reshape(-1, self.in_channels, *self.kernel)
        patches = patches.transpose(0, 2, 3, 4, 1).reshape(patches.shape[0], -1)
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        out = patches.astype(weight.dtype) @ weight.T
        if "bias" in self.proj:
            out = out + self.proj.bias
        return out


class VisionRotaryEmbedding:
    """2-D rotary embedding: the first half of each rotary pair set turns with the
    patch's row, the second half with its column (same frequencies for both)."""

    def __init__(self, head_dim: int, theta: float):
        axis_dim = head_dim // 2
        exponents = mx.arange(0, axis_dim, 2, dtype=mx.float32) / axis_dim
        self.inv_freq = 1.0 / (theta**exponents)
        mx.eval(self.inv_freq)  # a constant: not left lazy on the loading thread's stream

    def __call__(self, rows_cols: mx.array) -> tuple[mx.array, mx.array]:
        """(N, 2) row/column ids -> cos, sin of shape (N, head_dim)."""
        angles = rows_cols.astype(mx.float32)[:, :, None] * self.inv_freq  # (N, 2, hd/4)
        angles = angles.reshape(angles.shape[0], -1)  # rows' angles, then columns'
        angles = mx.concatenate([angles, angles], axis=-1)
        return mx.cos(angles), mx.sin(angles)


def apply_rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    # In float32 whatever the weights' dtype, as the reference does.
    return rotary_embedding.apply_rotary(x.astype(mx.float32), cos, sin).astype(x.dtype)


class VisionAttention(nn.Module):
    """``qkv_bias``/``proj_bias``: the Qwen towers have both; GLM-V's tower (which builds
    on this one, ``glm_vision``) has neither, and adds per-head ``q_norm``/``k_norm``
    where GLM-OCR's does."""

    def __init__(self, config: VisionConfig, qkv_bias: bool = True, proj_bias: bool = True):
        super().__init__()
        self.num_heads = config.num_heads
        self.scale = config.head_dim**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=qkv_bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=proj_bias)

    def __call__(self, x: mx.array, rotary, segments: Sequence[int]) -> mx.array:
        return self.proj(self.attend(x, rotary, segments))

    def attend(self, x: mx.array, rotary, segments: Sequence[int]) -> mx.array:
        """Attention within each segment (a frame or a window) of ``x`` (N, D) only,
        before the output projection: (N, D)."""
        N = x.shape[0]
        qkv = self.qkv(x).reshape(N, 3, self.num_heads, -1)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # (N, heads, head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        # Rotated in this layout, each patch's heads side by side: on MLX's CPU backend the
        # element-wise products are ~3.5x faster than on the (heads, N, head_dim) views
        # (Qwen2-VL-2B: 24 -> 7 ms per tensor and layer).
        cos, sin = (table[:, None] for table in rotary)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 0, 2) for t in (q, k, v))  # (heads, N, head_dim)
        # One attention call per segment: memory grows with the segments' sizes, not N^2.
        bounds = np.cumsum(segments)[:-1].tolist()
        outputs = [
            scaled_dot_product_attention(
                qs[None], ks[None], vs[None], scale=self.scale
            )[0]
            for qs, ks, vs in zip(
                mx.split(q, bounds, axis=1), mx.split(k, bounds, axis=1), mx.split(v, bounds, axis=1)
            )
        ]
        out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)
        return out.transpose(1, 0, 2).reshape(N, -1)


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1 -> activation -> fc2."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


def VisionGatedMLP(config: VisionConfig) -> GatedMLP:
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), all with biases."""
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=True)


class VisionLinearFcMLP(VisionMLP):
    """Qwen3-VL: Qwen2-VL's MLP, its layers named ``linear_fc1`` and ``linear_fc2`` (the
    checkpoint names); ``fc1``/``fc2`` reach them for the inherited forward pass."""

    def __init__(self, config: VisionConfig):
        super().__init__(config)
        self.linear_fc1 = self.pop("fc1")
        self.linear_fc2 = self.pop("fc2")

    fc1 = property(lambda self: self.linear_fc1)
    fc2 = property(lambda self: self.linear_fc2)


MLPS = {"fc": VisionMLP, "gated": VisionGatedMLP, "linear_fc": VisionLinearFcMLP}


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = make_norm(config.norm, config.hidden_size)
        self.norm2 = make_norm(config.norm, config.hidden_size)
        self.attn = VisionAttention(config)
        self.mlp = MLPS[config.mlp](config)

    def __call__(self, x: mx.array, rotary, segments: Sequence[int]) -> mx.array:
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Normalize each patch, concatenate each merge block's patches, project to the text width."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merged_dim = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = make_norm(config.norm, config.hidden_size)
        # A list, so checkpoint names are mlp.0 / mlp.2 as in the reference's nn.Sequential.
        self.mlp = [
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, config.out_hidden_size),
        ]

    def __call__(self, x: mx.array) -> mx.array:
        x = self.ln_q(x).reshape(-1, self.merged_dim)
        for layer in self.mlp:
            x = layer(x)
        return x


class LinearFcPatchMerger(nn.Module):
    """Qwen3-VL's merger: the same maths under other names, and (``postshuffle_norm``,
    DeepStack's mergers) the norm taken over each merged block instead of each patch."""

    def __init__(self, config: VisionConfig, postshuffle_norm: bool = False):
        super().__init__()
        self.merged_dim = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(
            self.merged_dim if postshuffle_norm else config.hidden_size, eps=1e-6
        )
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, config.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.merged_dim))
        else:
            x = self.norm(x).reshape(-1, self.merged_dim)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


def make_merger(config: VisionConfig, postshuffle_norm: bool = False) -> nn.Module:
    if config.merger == "linear_fc":
        return LinearFcPatchMerger(config, postshuffle_norm)
    if config.merger == "mlp" and not postshuffle_norm:
        return PatchMerger(config)
    raise ValueError(f"unknown vision merger {config.merger!r}")


def patch_rows_cols(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """(N, 2) row and column of every patch, in the processor's merge-block order."""
    rows_cols = []
    for t, h, w in grid_thw.tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        # (h, w) -> (h/m, w/m, m, m): each merge block's patches become contiguous
        rows = rows.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3)
        cols = cols.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3)
        frame = np.stack([rows.reshape(-1), cols.reshape(-1)], axis=-1)
        rows_cols.append(np.tile(frame, (t, 1)))
    return np.concatenate(rows_cols, axis=0)


def bilinear_position_taps(
    grid_thw: np.ndarray, merge: int, side: int, align_corners: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Per patch (processor order): the 4 cells of a ``side`` x ``side`` learned position
    table and their weights that resample it bilinearly to the image's patch grid, as
    torch's ``interpolate`` does with ``align_corners`` (corners aligned: Qwen3-VL; else
    half-pixel centres with the border cell repeated: PaddleOCR-VL). Returns (N, 4) int
    indices and (N, 4) float32 weights."""
    rows_cols = patch_rows_cols(grid_thw, merge).astype(np.float32)
    sizes = np.concatenate(
        [np.tile([[h, w]], (t * h * w, 1)) for t, h, w in grid_thw.tolist()]
    ).astype(np.float32)
    # Each axis: source coordinate, its floor/ceil cells and linear weights.
    if align_corners:
        src = rows_cols * np.float32(side - 1) / np.maximum(sizes - 1, 1)
    else:
        src = (rows_cols + np.float32(0.5)) * np.float32(side) / sizes - np.float32(0.5)
    lower = np.floor(src)
    frac = (src - lower).astype(np.float32)
    lower = lower.astype(np.int64)
    upper = np.clip(lower + 1, 0, side - 1)
    lower = np.clip(lower, 0, side - 1)
    (r0, c0), (r1, c1) = lower.T, upper.T
    (fr, fc) = frac.T
    indices = np.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], -1)
    weights = np.stack(
        [(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], -1
    ).astype(np.float32)
    return indices, weights


def frame_segments(grid_thw: np.ndarray) -> list[int]:
    """Full attention runs within each frame: h*w patches, t times per image/video."""
    return [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]


def window_partition(
    grid_thw: np.ndarray, merge: int, window: int
) -> tuple[np.ndarray, list[int]]:
    """Reorder merge blocks window by window (``window`` x ``window`` merge blocks each,
    row-major over each frame; edge windows are smaller). Returns the merge-block order
    and each window's length in patches."""
    order, lengths = [], []
    first = 0
    for t, h, w in grid_thw.tolist():
        blocks = np.arange(t * (h // merge) * (w // merge)).reshape(t, h // merge, w // merge)
        for frame in blocks + first:
            for top in range(0, frame.shape[0], window):
                for left in range(0, frame.shape[1], window):
                    members = frame[top : top + window, left : left + window].reshape(-1)
                    order.append(members)
                    lengths.append(members.size * merge * merge)
        first += blocks.size
    return np.concatenate(order), lengths


class QwenVisionTransformer(nn.Module):
    """``vision_tower`` in checkpoints: pixels (N, C*T*P*P) and grids -> (N / merge^2, D_text)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        if config.num_position_embeddings is not None:
            self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = [VisionBlock(config) for _ in range(config.depth)]
        self.merger = make_merger(config)
        if config.deepstack_visual_indexes:
            self.deepstack_merger_list = [
                make_merger(config, postshuffle_norm=True)
                for _ in config.deepstack_visual_indexes
            ]
        self.rotary = VisionRotaryEmbedding(config.head_dim, config.rope_theta)

    def __call__(self, pixel_values: mx.array, grid_thw: np.ndarray) -> mx.array:
        return self.encode(pixel_values, grid_thw)[0]

    def encode(
        self, pixel_values: mx.array, grid_thw: np.ndarray
    ) -> tuple[mx.array, list[mx.array]]:
        """The merged tokens (N / merge^2, D_text) and, per DeepStack tap, the same-shaped
        tokens merged from that block's output (empty without DeepStack)."""
        config = self.config
        grid_thw = grids_thw(grid_thw)
        merge = config.spatial_merge_size
        unit = merge * merge
        x = self.patch_embed(pixel_values)
        if config.num_position_embeddings is not None:
            side = int(config.num_position_embeddings**0.5)
            indices, weights = bilinear_position_taps(grid_thw, merge, side)
            table = self.pos_embed(mx.array(indices))  # (N, 4, D)
            x = x + (table * mx.array(weights)[:, :, None]).sum(axis=1).astype(x.dtype)
        rows_cols = patch_rows_cols(grid_thw, merge)
        full = frame_segments(grid_thw)

        windowed = config.window_size is not None
        if windowed:
            window = config.window_size // merge // config.patch_size
            order, windows = window_partition(grid_thw, merge, window)
            # Move whole merge blocks so that every window is a contiguous segment.
            patch_order = (order[:, None] * unit + np.arange(unit)).reshape(-1)
            x = x[mx.array(patch_order)]
            rows_cols = rows_cols[patch_order]
        rotary = self.rotary(mx.array(rows_cols))  # cos, sin: (N, head_dim)

        deepstack = []
        for index, block in enumerate(self.blocks):
            use_full = not windowed or index in config.fullatt_block_indexes
            x = block(x, rotary, full if use_full else windows)
            if index in config.deepstack_visual_indexes:
                tap = config.deepstack_visual_indexes.index(index)
                deepstack.append(self.deepstack_merger_list[tap](x))
            run_ahead.layer_done(x, *deepstack)

        merged = [self.merger(x), *deepstack]
        if windowed:
            restore = mx.array(np.argsort(order))
            merged = [m[restore] for m in merged]
        return merged[0], merged[1:]
