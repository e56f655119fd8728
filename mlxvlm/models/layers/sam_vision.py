"""SAM's ViT image encoder (Kirillov et al., 2023) as DeepSeek-OCR's towers use it:
patch embedding, an absolute position table, blocks with windowed or global attention
biased by decomposed relative positions, the convolutional neck, and the two stride-2
convolutions that shrink the map 4x per side before the next encoder.

Sizes other than the table's (DeepSeek-OCR 2's 768-pixel tiles on a 1024-pixel table) are
met as transformers meets them: the position table resized by antialiased bicubic
interpolation, a global block's relative tables by linear interpolation
(``interpolation.py``: the same weights PyTorch computes, as matrices).

Names are SAM's own, which DeepSeek's checkpoints and mlx-community's conversions keep:
``patch_embed.proj``, ``pos_embed``, ``blocks.N.{norm1,attn.{qkv,proj,rel_pos_h,rel_pos_w},
norm2,mlp.{lin1,lin2}}``, ``neck.{0,1,2,3}`` (1x1 convolution, LayerNorm, 3x3
convolution, LayerNorm), ``net_2`` and ``net_3`` (the stride-2 convolutions);
transformers 5 renames them (``layers.N.layer_norm1``, ``neck.conv1``, ``proj.conv1``...).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.cpu.ops import scaled_dot_product_attention
from mlxvlm.models.layers.activations import activation
from mlxvlm.models.layers.interpolation import bicubic_antialiased_matrix, linear_matrix


# Bias elements per band of query rows in an attention (64 MB in float32).
BIAS_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class SamVisionConfig:
    hidden_size: int = 768
    output_channels: int = 256
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 1024
    patch_size: int = 16
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True
    mlp_dim: int = 3072
    use_abs_pos: bool = True
    use_rel_pos: bool = True
    window_size: int = 14
    global_attn_indexes: tuple[int, ...] = (2, 5, 8, 11)
    downsample_channels: tuple[int, int] = (512, 896)

    @property
    def grid(self) -> int:
        """Patches per side of the image size the tables were trained at."""
        return self.image_size // self.patch_size


class SamAttention(nn.Module):
    def __init__(self, config: SamVisionConfig, table_size: int):
        """``table_size``: the side the relative tables cover (the window, or the whole
        grid for a global block)."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        head_dim = config.hidden_size // self.num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.qkv_bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.use_rel_pos = config.use_rel_pos
        if self.use_rel_pos:
            self.rel_pos_h = mx.zeros((2 * table_size - 1, head_dim))
            self.rel_pos_w = mx.zeros((2 * table_size - 1, head_dim))

    def __call__(self, x: mx.array) -> mx.array:
        B, H, W, C = x.shape
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B, heads, H*W, head_dim)
        if not self.use_rel_pos:
            out = scaled_dot_product_attention(q, k, v, scale=self.scale)
        else:
            rh = relative_table(self.rel_pos_h, H)  # (H, H, dim)
            rw = relative_table(self.rel_pos_w, W)
            # The bias is heads x tokens^2 (12 x 4096^2 for a global block of a 1024-px
            # view): built and used a band of query rows at a time, never whole.
            rows = max(1, BIAS_ELEMENTS // (B * self.num_heads * W * H * W))
            out = mx.concatenate([
                scaled_dot_product_attention(
                    q[:, :, top * W:(top + rows) * W], k, v, scale=self.scale,
                    mask=relative_bias(q, rh, rw, H, W, top, min(top + rows, H)))
                for top in range(0, H, rows)], axis=2)
        out = out.reshape(B, self.num_heads, H, W, -1).transpose(0, 2, 3, 1, 4).reshape(B, H, W, C)
        return self.proj(out)


def relative_bias(q: mx.array, rh: mx.array, rw: mx.array, H: int, W: int, top: int,
                  bottom: int) -> mx.array:
    """The decomposed relative-position term added to the scores of the queries in map
    rows ``top:bottom`` (unscaled queries, as SAM adds it): (B, heads, rows*W, H*W)."""
    B, heads, _, dim = q.shape
    rows = bottom - top
    r_q = q[:, :, top * W:bottom * W].reshape(B, heads, rows, W, dim)
    rel_h = mx.einsum("bnhwc,hkc->bnhwk", r_q, rh[top:bottom])
    rel_w = mx.einsum("bnhwc,wkc->bnhwk", r_q, rw)
    bias = rel_h[..., :, None] + rel_w[..., None, :]  # (B, heads, rows, W, H, W)
    return bias.reshape(B, heads, rows * W, H * W)


def relative_table(rel_pos: mx.array, size: int) -> mx.array:
    """(size, size, dim): the table's row for each query/key offset, the table first
    resized linearly to ``2 * size - 1`` rows where it has another length."""
    length = 2 * size - 1
    if rel_pos.shape[0] != length:
        resize = mx.array(linear_matrix(rel_pos.shape[0], length), dtype=mx.float32)
        rel_pos = (resize @ rel_pos.astype(mx.float32)).astype(rel_pos.dtype)
    offsets = np.arange(size)[:, None] - np.arange(size)[None, :] + size - 1
    return rel_pos[mx.array(offsets)]


class SamMLP(nn.Module):
    def __init__(self, config: SamVisionConfig):
        super().__init__()
        self.lin1 = nn.Linear(config.hidden_size, config.mlp_dim)
        self.lin2 = nn.Linear(config.mlp_dim, config.hidden_size)
        self.act = activation(config.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.lin2(self.act(self.lin1(x)))


class SamBlock(nn.Module):
    def __init__(self, config: SamVisionConfig, window_size: int):
        """``window_size`` 0: global attention over the whole map."""
        super().__init__()
        self.window_size = window_size
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = SamAttention(config, window_size or config.grid)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SamMLP(config)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.norm1(x)
        if self.window_size:
            h = self.windowed(h)
        else:
            h = self.attn(h)
        x = x + h
        return x + self.mlp(self.norm2(x))

    def windowed(self, h: mx.array) -> mx.array:
        """Attention within non-overlapping windows; the map is padded with zeros to
        whole windows (the padding takes part in the windows' attention, unmasked, as in
        SAM) and cut back after."""
        B, H, W, C = h.shape
        w = self.window_size
        pad_h, pad_w = -H % w, -W % w
        if pad_h or pad_w:
            h = mx.pad(h, [(0, 0), (0, pad_h), (0, pad_w), (0, 0)])
        Hp, Wp = H + pad_h, W + pad_w
        windows = h.reshape(B, Hp // w, w, Wp // w, w, C).transpose(0, 1, 3, 2, 4, 5)
        out = self.attn(windows.reshape(-1, w, w, C))
        out = out.reshape(B, Hp // w, Wp // w, w, w, C).transpose(0, 1, 3, 2, 4, 5)
        return out.reshape(B, Hp, Wp, C)[:, :H, :W, :]


class SamPatchEmbed(nn.Module):
    def __init__(self, config: SamVisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(config.num_channels, config.hidden_size,
                              kernel_size=config.patch_size, stride=config.patch_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        return self.proj(pixels)


class SamVisionEncoder(nn.Module):
    """(N, H, W, C) channels-last pixels -> (N, H/patch/4 * W/patch/4, channels) features,
    row-major."""

    def __init__(self, config: SamVisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = SamPatchEmbed(config)
        if config.use_abs_pos:
            self.pos_embed = mx.zeros((1, config.grid, config.grid, config.hidden_size))
        self.blocks = [
            SamBlock(config, 0 if i in config.global_attn_indexes else config.window_size)
            for i in range(config.num_hidden_layers)
        ]
        channels = config.output_channels
        # 1x1 and 3x3 convolutions to ``output_channels``, each with a LayerNorm over them
        self.neck = [
            nn.Conv2d(config.hidden_size, channels, kernel_size=1, bias=False),
            nn.LayerNorm(channels, eps=1e-6),
            nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False),
            nn.LayerNorm(channels, eps=1e-6),
        ]
        # the map 4x smaller per side, wider
        first, second = config.downsample_channels
        self.net_2 = nn.Conv2d(channels, first, 3, stride=2, padding=1, bias=False)
        self.net_3 = nn.Conv2d(first, second, 3, stride=2, padding=1, bias=False)

    def __call__(self, pixels: mx.array) -> mx.array:
        h = self.patch_embed(pixels)
        if self.config.use_abs_pos:
            h = h + self.positions(h.shape[1], h.shape[2]).astype(h.dtype)
        for block in self.blocks:
            h = block(h)
        for layer in self.neck:
            h = layer(h)
        h = self.net_3(self.net_2(h))
        return h.reshape(h.shape[0], -1, h.shape[-1])

    def positions(self, height: int, width: int) -> mx.array:
        """The position table at ``height`` x ``width`` patches: as trained, or resized
        (antialiased bicubic, in float32)."""
        table = self.pos_embed
        if table.shape[1:3] == (height, width):
            return table
        rows = mx.array(bicubic_antialiased_matrix(table.shape[1], height), dtype=mx.float32)
        cols = mx.array(bicubic_antialiased_matrix(table.shape[2], width), dtype=mx.float32)
        resized = mx.einsum("ih,jw,bhwc->bijc", rows, cols, table.astype(mx.float32))
        return resized.astype(table.dtype)
