"""MobileNetV5 (Gemma 3n's vision tower, timm's ``mobilenetv5_*_enc``) in MLX, channels last.

The network is built from a block layout, as timm builds it: a list of stages, each a list
of blocks — edge residuals (``er``), universal inverted residuals (``uir``) and mobile
multi-query attention (``mqa``) — either the decoded block arguments a config gives in
``vision_config.model_args["block_args"]`` or timm's definition of the named architecture,
written in timm's block strings. A multi-scale fusion adapter (MSFA) then resizes the
chosen stage outputs to the highest resolution among them, fuses them with an inverted
residual and pools them to ``msfa_output_resolution`` squared tokens.

Module names are timm's (``conv_stem.conv``, ``blocks.<stage>.<block>.pw_exp.bn``, ...), so
that Gemma 3n checkpoints' ``vision_tower.timm_model.*`` tensors load onto them; convolution
weights are MLX's (out, kh, kw, in).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# timm's mobilenetv5_300m_enc (Gemma 3n's tower), as timm writes it.
MOBILENETV5_300M = [
    ["er_r1_k3_s2_e4_c128", "er_r1_k3_s1_e4_c128", "er_r1_k3_s1_e4_c128"],
    ["uir_r1_a3_k5_s2_e6_c256", "uir_r1_a5_k0_s1_e4_c256", "uir_r1_a3_k0_s1_e4_c256",
     "uir_r1_a5_k0_s1_e4_c256", "uir_r1_a3_k0_s1_e4_c256"],
    ["uir_r1_a5_k5_s2_e6_c640"] + ["uir_r1_a5_k0_s1_e4_c640"] * 7 + ["uir_r1_a0_k0_s1_e1_c640"]
    + ["mqa_r1_k3_h12_v2_s1_d64_c640", "uir_r1_a0_k0_s1_e2_c640"] * 14,
    ["uir_r1_a5_k5_s2_e6_c1280"]
    + ["mqa_r1_k3_h16_s1_d96_c1280", "uir_r1_a0_k0_s1_e2_c1280"] * 19,
]
ARCHITECTURES = {"mobilenetv5_300m_enc": MOBILENETV5_300M}
MSFA_CHANNELS = 2048  # timm fixes the adapter's output width
OUTPUT_STRIDE = 32

# model_args keys that only choose what mlxvlm does anyway (or change nothing at inference).
_INERT_ARGS = {"drop_rate", "drop_path_rate", "pretrained", "num_classes", "features_only"}
_ARGS = {"block_args", "stem_size", "stem_bias", "fix_stem", "pad_type", "msfa_indices",
         "msfa_output_resolution", "layer_scale_init_value", "channel_multiplier", "group_size",
         "in_chans"}


# ----------------------------------------------------------------------------- config


def decode_block(text: str) -> list[dict]:
    """One timm block string (``uir_r1_a3_k5_s2_e6_c256``) -> its decoded arguments,
    repeated ``r`` times."""
    block_type, *ops = text.split("_")
    options, skip = {}, None
    for op in ops:
        if op == "noskip":
            skip = False
        elif op == "skip":
            skip = True
        else:
            key, value = re.split(r"(\d.*)", op)[:2]
            options[key] = value
    if "n" in options:
        raise NotImplementedError(f"MobileNetV5 block {text!r}: per-block activations")
    args: dict[str, Any] = dict(block_type=block_type, out_chs=int(options["c"]),
                                stride=int(options["s"]), noskip=skip is False)
    if block_type == "er":
        args.update(exp_kernel_size=int(options["k"]), exp_ratio=float(options["e"]),
                    pw_kernel_size=int(options.get("p", 1)), force_in_chs=int(options.get("fc", 0)))
    elif block_type == "uir":
        args.update(dw_kernel_size_start=int(options.get("a", 0)), dw_kernel_size_mid=int(options["k"]),
                    dw_kernel_size_end=int(options.get("p", 0)), exp_ratio=float(options["e"]))
    elif block_type == "mqa":
        args.update(dw_kernel_size=int(options["k"]), num_heads=int(options["h"]),
                    key_dim=int(options["d"]), value_dim=int(options["d"]),
                    kv_stride=int(options.get("v", 1)))
    else:
        raise NotImplementedError(f"MobileNetV5 block type {block_type!r}")
    if "gs" in options:
        args["group_size"] = int(options["gs"])
    return [dict(args) for _ in range(int(options["r"]))]


def make_divisible(v: float, divisor: int = 8, round_limit: float = 0.9) -> int:
    """timm's channel rounding: the nearest multiple of ``divisor``, not below 90% of ``v``."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < round_limit * v else new_v


@dataclass
class MobileNetV5Config:
    stages: list[list[dict]]
    stem_size: int = 64
    stem_bias: bool = True
    pad_type: str = "same"
    msfa_indices: tuple[int, ...] = (-2, -1)
    msfa_output_resolution: int = 16
    layer_scale_init_value: float | None = 1e-5
    channel_multiplier: float = 1.0
    in_chans: int = 3
    fix_stem: bool = False
    eps: float = 1e-6

    @classmethod
    def from_hf(cls, vision: dict) -> "MobileNetV5Config":
        """From Gemma 3n's ``vision_config``: ``architecture`` and ``model_args`` as
        transformers passes them to ``timm.create_model``."""
        architecture = vision.get("architecture", "mobilenetv5_300m_enc")
        args = dict(vision.get("model_args") or {})
        unknown = set(args) - _ARGS - _INERT_ARGS
        if unknown:
            raise NotImplementedError(f"MobileNetV5 model_args {sorted(unknown)} are not supported")
        if architecture not in ARCHITECTURES:
            raise NotImplementedError(f"vision architecture {architecture!r} is not supported")
        group_size = args.get("group_size")
        if args.get("block_args") is not None:
            stages = [[dict(b) for b in stage] for stage in args["block_args"]]
        else:
            stages = [[b for text in stage for b in decode_block(text)]
                      for stage in ARCHITECTURES[architecture]]
            if group_size is not None:
                for block in (b for stage in stages for b in stage):
                    block["group_size"] = group_size
        multiplier = args.get("channel_multiplier", 1.0)
        return cls(
            stages=stages, stem_size=args.get("stem_size", 64), stem_bias=args.get("stem_bias", True),
            pad_type=args.get("pad_type", "same"),
            msfa_indices=tuple(args.get("msfa_indices", (-2, -1))),
            msfa_output_resolution=args.get("msfa_output_resolution", 16),
            layer_scale_init_value=args.get("layer_scale_init_value", 1e-5),
            channel_multiplier=multiplier, in_chans=args.get("in_chans", 3),
            fix_stem=args.get("fix_stem", multiplier < 1.0),
        )

    def round_channels(self, channels: int) -> int:
        if not self.channel_multiplier:
            return channels
        return make_divisible(channels * self.channel_multiplier)


# ---------------------------------------------------------------------------- layers


def gelu(x: mx.array) -> mx.array:
    return nn.gelu_approx(x)


class RmsNorm2d(nn.Module):
    """RMS norm over the channels of each pixel, optionally followed by GELU (timm's
    ``RmsNorm2d`` / ``RmsNormAct2d``)."""

    def __init__(self, channels: int, eps: float = 1e-6, act: bool = False):
        super().__init__()
        self.weight = mx.ones((channels,))
        self.eps = eps
        self.act = act

    def __call__(self, x: mx.array) -> mx.array:
        x = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.weight
        return gelu(x) if self.act else x


def same_padding(size: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """TensorFlow's 'SAME' padding of one axis: the odd pixel goes after."""
    total = max((math.ceil(size / stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


class Conv2d(nn.Module):
    """timm's ``create_conv2d``: symmetric padding where that is static, TensorFlow's
    'SAME' padding computed from the input otherwise (``pad_type == "same"``)."""

    def __init__(self, in_chs: int, out_chs: int, kernel: int, stride: int = 1, dilation: int = 1,
                 groups: int = 1, bias: bool = False, pad_type: str = ""):
        super().__init__()
        self.weight = mx.zeros((out_chs, kernel, kernel, in_chs // groups))
        if bias:
            self.bias = mx.zeros((out_chs,))
        self.kernel, self.stride, self.dilation, self.groups = kernel, stride, dilation, groups
        static = stride == 1 and (dilation * (kernel - 1)) % 2 == 0
        self.dynamic = pad_type == "same" and not static
        self.padding = 0 if self.dynamic else ((stride - 1) + dilation * (kernel - 1)) // 2

    def __call__(self, x: mx.array) -> mx.array:
        padding = self.padding
        if self.dynamic:
            ph = same_padding(x.shape[1], self.kernel, self.stride, self.dilation)
            pw = same_padding(x.shape[2], self.kernel, self.stride, self.dilation)
            x = mx.pad(x, [(0, 0), ph, pw, (0, 0)])
            padding = 0
        y = mx.conv2d(x, self.weight, stride=self.stride, padding=padding,
                      dilation=self.dilation, groups=self.groups)
        return y + self.bias if "bias" in self else y


class ConvNormAct(nn.Module):
    def __init__(self, in_chs, out_chs, kernel, *, stride=1, dilation=1, groups=1, bias=False,
                 pad_type="", act=True, eps=1e-6):
        super().__init__()
        self.conv = Conv2d(in_chs, out_chs, kernel, stride, dilation, groups, bias, pad_type)
        self.bn = RmsNorm2d(out_chs, eps, act)

    def __call__(self, x):
        return self.bn(self.conv(x))


class LayerScale2d(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.gamma = mx.zeros((channels,))

    def __call__(self, x):
        return x * self.gamma


def groups_of(group_size: int | None, channels: int) -> int:
    """timm's ``num_groups``: 0/None is a dense convolution, else groups of ``group_size``."""
    return 1 if not group_size else channels // group_size


class EdgeResidual(nn.Module):
    """A full convolution expanding the channels, then a pointwise projection."""

    def __init__(self, b: dict, in_chs: int, cfg: MobileNetV5Config):
        super().__init__()
        out_chs, stride = b["out_chs"], b["stride"]
        base = b.get("force_in_chs") or in_chs
        mid = make_divisible(base * b.get("exp_ratio", 1.0))
        self.conv_exp = Conv2d(in_chs, mid, b.get("exp_kernel_size", 3), stride, b["dilation"],
                               groups_of(b.get("group_size", 0), mid), pad_type=cfg.pad_type)
        self.bn1 = RmsNorm2d(mid, cfg.eps, act=True)
        self.conv_pwl = Conv2d(mid, out_chs, b.get("pw_kernel_size", 1), pad_type=cfg.pad_type)
        self.bn2 = RmsNorm2d(out_chs, cfg.eps)
        self.has_skip = in_chs == out_chs and stride == 1 and not b.get("noskip", False)

    def __call__(self, x):
        y = self.bn2(self.conv_pwl(self.bn1(self.conv_exp(x))))
        return y + x if self.has_skip else y


class UniversalInvertedResidual(nn.Module):
    """Optional depthwise convolution, pointwise expansion, optional depthwise convolution,
    pointwise projection, optional depthwise convolution; each depthwise one may stride."""

    def __init__(self, b: dict, in_chs: int, cfg: MobileNetV5Config, layer_scale: bool = True):
        super().__init__()
        out_chs, stride, dilation = b["out_chs"], b["stride"], b.get("dilation", 1)
        start, mid_k, end = (b.get("dw_kernel_size_start", 0), b.get("dw_kernel_size_mid", 3),
                             b.get("dw_kernel_size_end", 0))
        group_size = b.get("group_size", 1)
        pad = cfg.pad_type
        if start:
            self.dw_start = ConvNormAct(in_chs, in_chs, start, stride=1 if mid_k else stride,
                                        dilation=dilation, groups=groups_of(group_size, in_chs),
                                        pad_type=pad, act=False, eps=cfg.eps)
        mid = make_divisible(in_chs * b.get("exp_ratio", 1.0))
        self.pw_exp = ConvNormAct(in_chs, mid, 1, pad_type=pad, eps=cfg.eps)
        if mid_k:
            self.dw_mid = ConvNormAct(mid, mid, mid_k, stride=stride, dilation=dilation,
                                      groups=groups_of(group_size, mid), pad_type=pad, eps=cfg.eps)
        self.pw_proj = ConvNormAct(mid, out_chs, 1, pad_type=pad, act=False, eps=cfg.eps)
        if end:
            end_stride = stride if not start and not mid_k else 1
            self.dw_end = ConvNormAct(out_chs, out_chs, end, stride=end_stride, dilation=dilation,
                                      groups=groups_of(group_size, out_chs), pad_type=pad,
                                      act=False, eps=cfg.eps)
        if layer_scale and cfg.layer_scale_init_value is not None:
            self.layer_scale = LayerScale2d(out_chs)
        self.has_skip = in_chs == out_chs and stride == 1 and not b.get("noskip", False)

    def __call__(self, x):
        y = x
        for name in ("dw_start", "pw_exp", "dw_mid", "pw_proj", "dw_end", "layer_scale"):
            if name in self:
                y = self[name](y)
        return y + x if self.has_skip else y


class Projection(nn.Module):
    """A query/key/value/output path of multi-query attention: an optional strided
    depthwise convolution and norm, then a 1x1 projection (timm's ``nn.Sequential``)."""

    def __init__(self, dim: int, out: int, cfg: MobileNetV5Config, stride: int = 1,
                 kernel: int = 3, dilation: int = 1):
        super().__init__()
        if stride > 1:
            self.down_conv = Conv2d(dim, dim, kernel, stride, dilation, groups=dim, pad_type=cfg.pad_type)
            self.norm = RmsNorm2d(dim, cfg.eps)
        self.proj = Conv2d(dim, out, 1)

    def __call__(self, x):
        if "down_conv" in self:
            x = self.norm(self.down_conv(x))
        return self.proj(x)


class MultiQueryAttention2d(nn.Module):
    """Attention over the pixels with one key/value head, keys and values optionally from a
    strided (downsampled) map."""

    def __init__(self, b: dict, dim: int, cfg: MobileNetV5Config):
        super().__init__()
        if any(s > 1 for s in _pair(b.get("query_strides", 1))):
            raise NotImplementedError("MobileNetV5 attention with query strides")
        self.num_heads, self.key_dim, self.value_dim = b["num_heads"], b["key_dim"], b["value_dim"]
        kv = dict(stride=b.get("kv_stride", 1), kernel=b.get("dw_kernel_size", 3),
                  dilation=b.get("dilation", 1))
        self.query = Projection(dim, self.num_heads * self.key_dim, cfg)
        self.key = Projection(dim, self.key_dim, cfg, **kv)
        self.value = Projection(dim, self.value_dim, cfg, **kv)
        self.output = Projection(self.num_heads * self.value_dim, b["out_chs"], cfg)

    def __call__(self, x):
        B, H, W, _ = x.shape
        q = self.query(x).reshape(B, H * W, self.num_heads, self.key_dim).transpose(0, 2, 1, 3)
        k = self.key(x).reshape(B, 1, -1, self.key_dim)
        v = self.value(x).reshape(B, 1, -1, self.value_dim)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.key_dim**-0.5)
        o = o.transpose(0, 2, 1, 3).reshape(B, H, W, self.num_heads * self.value_dim)
        return self.output(o)


class MobileAttention(nn.Module):
    def __init__(self, b: dict, in_chs: int, cfg: MobileNetV5Config):
        super().__init__()
        if b.get("use_cpe"):
            raise NotImplementedError("MobileNetV5 attention with a conditional position encoding")
        self.norm = RmsNorm2d(in_chs, cfg.eps)
        self.attn = MultiQueryAttention2d(b, in_chs, cfg)
        if cfg.layer_scale_init_value is not None:
            self.layer_scale = LayerScale2d(b["out_chs"])
        self.has_skip = b["stride"] == 1 and in_chs == b["out_chs"] and not b.get("noskip", False)

    def __call__(self, x):
        y = self.attn(self.norm(x))
        if "layer_scale" in self:
            y = self.layer_scale(y)
        return y + x if self.has_skip else y


def _pair(v):
    return tuple(v) if isinstance(v, (list, tuple)) else (v, v)


BLOCKS = {"er": EdgeResidual, "uir": UniversalInvertedResidual, "mqa": MobileAttention}


# --------------------------------------------------------------------------- resizing


def _source_index(out_size: int, in_size: int) -> mx.array:
    """PyTorch's 'nearest' source pixel of each output pixel."""
    return mx.floor(mx.arange(out_size, dtype=mx.float32) * (in_size / out_size)).astype(mx.int32)


def resize_nearest(x: mx.array, size: tuple[int, int]) -> mx.array:
    x = mx.take(x, _source_index(size[0], x.shape[1]), axis=1)
    return mx.take(x, _source_index(size[1], x.shape[2]), axis=2)


def _linear_axis(x: mx.array, out_size: int, axis: int) -> mx.array:
    """PyTorch's bilinear resampling (align_corners=False, no antialiasing) of one axis."""
    in_size = x.shape[axis]
    src = (mx.arange(out_size, dtype=mx.float32) + 0.5) * (in_size / out_size) - 0.5
    src = mx.maximum(src, 0.0)
    lo = mx.minimum(mx.floor(src).astype(mx.int32), in_size - 1)
    hi = mx.minimum(lo + 1, in_size - 1)
    shape = [1] * x.ndim
    shape[axis] = out_size
    w = (src - lo.astype(mx.float32)).reshape(shape).astype(x.dtype)
    return mx.take(x, lo, axis=axis) * (1 - w) + mx.take(x, hi, axis=axis) * w


def resize_bilinear(x: mx.array, size: tuple[int, int]) -> mx.array:
    return _linear_axis(_linear_axis(x, size[0], 1), size[1], 2)


# ---------------------------------------------------------------------------- encoder


class MultiScaleFusionAdapter(nn.Module):
    def __init__(self, in_chs: int, cfg: MobileNetV5Config):
        super().__init__()
        ffn = dict(block_type="uir", out_chs=MSFA_CHANNELS, stride=1, dw_kernel_size_mid=0,
                   exp_ratio=2.0, noskip=True)
        self.ffn = UniversalInvertedResidual(ffn, in_chs, cfg, layer_scale=False)
        self.norm = RmsNorm2d(MSFA_CHANNELS, cfg.eps)
        self.output_resolution = (cfg.msfa_output_resolution,) * 2

    def __call__(self, features: list[mx.array]) -> mx.array:
        high = features[0].shape[1:3]
        resized = [f if f.shape[1] >= high[0] and f.shape[2] >= high[1] else resize_nearest(f, high)
                   for f in features]
        x = self.ffn(mx.concatenate(resized, axis=-1))
        oh, ow = self.output_resolution
        if tuple(high) != (oh, ow):
            if high[0] % oh or high[1] % ow:
                x = resize_bilinear(x, (oh, ow))
            else:
                sh, sw = high[0] // oh, high[1] // ow
                B, _, _, C = x.shape
                x = x.reshape(B, oh, sh, ow, sw, C).mean(axis=(2, 4))
        return self.norm(x)


class MobileNetV5Encoder(nn.Module):
    """(B, H, W, C) pixels -> (B, r, r, 2048) features, r = ``msfa_output_resolution``."""

    def __init__(self, cfg: MobileNetV5Config):
        super().__init__()
        stem = cfg.stem_size if cfg.fix_stem else cfg.round_channels(cfg.stem_size)
        self.conv_stem = ConvNormAct(cfg.in_chans, stem, 3, stride=2, bias=cfg.stem_bias,
                                     pad_type=cfg.pad_type, eps=cfg.eps)
        self.blocks, feature_channels = self._build(cfg, stem)
        n = len(feature_channels)
        self.msfa_indices = [i % n for i in cfg.msfa_indices]
        self.msfa = MultiScaleFusionAdapter(sum(feature_channels[i] for i in self.msfa_indices), cfg)

    @staticmethod
    def _build(cfg: MobileNetV5Config, in_chs: int):
        """The stages as timm's EfficientNetBuilder lays them out (strides beyond the output
        stride of 32 become dilation), and the channels of the features it records."""
        stride, dilation = 2, 1
        features = [in_chs] if cfg.stages[0][0]["stride"] > 1 else []
        stages = []
        for s, stage in enumerate(cfg.stages):
            blocks = []
            for i, spec in enumerate(stage):
                b = dict(spec)
                b["out_chs"] = cfg.round_channels(b["out_chs"])
                if i >= 1:
                    b["stride"] = 1
                next_dilation = dilation
                if b["stride"] > 1:
                    if stride * b["stride"] > OUTPUT_STRIDE:
                        next_dilation, b["stride"] = dilation * b["stride"], 1
                    else:
                        stride *= b["stride"]
                b["dilation"] = dilation
                dilation = next_dilation
                kind = b.get("block_type")
                if kind not in BLOCKS:
                    raise NotImplementedError(f"MobileNetV5 block type {kind!r}")
                blocks.append(BLOCKS[kind](b, in_chs, cfg))
                in_chs = b["out_chs"]
            last = s + 1 == len(cfg.stages)
            if last or cfg.stages[s + 1][0]["stride"] > 1:
                features.append(in_chs)
            stages.append(blocks)
        return stages, features

    def __call__(self, x: mx.array) -> mx.array:
        x = self.conv_stem(x)
        intermediates = [x] if 0 in self.msfa_indices else []
        for i, stage in enumerate(self.blocks, start=1):
            for block in stage:
                x = block(x)
            if i in self.msfa_indices:
                intermediates.append(x)
        return self.msfa(intermediates)


def convert_hf_weight(name: str, value: mx.array) -> mx.array:
    """A PyTorch (out, in, kh, kw) convolution weight -> MLX's (out, kh, kw, in)."""
    return value.transpose(0, 2, 3, 1) if value.ndim == 4 else value
