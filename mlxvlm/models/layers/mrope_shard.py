"""Tensor parallelism of the M-RoPE decoder's blocks (``mrope_decoder.DecoderLayer``),
as mlx-lm's models' ``shard``: mlx.nn's sharded linear layers, the all-reduce in them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear


def shard_attention(attention: nn.Module, group: mx.distributed.Group) -> None:
    """This rank's 1/size of the heads: q/k/v split by output, o_proj by input and
    all-reduced. Per-head norms (Qwen3's q/k norms) act per head: unchanged."""
    for name in ("q_proj", "k_proj", "v_proj"):
        attention[name] = shard_linear(attention[name], "all-to-sharded", group=group)
    attention.o_proj = shard_linear(attention.o_proj, "sharded-to-all", group=group)
    attention.n_heads //= group.size()
    attention.n_kv_heads //= group.size()


def shard_gated_mlp(mlp: nn.Module, group: mx.distributed.Group) -> None:
    """gate/up split by output, down by input and all-reduced."""
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def shard_layers(layers: list, group: mx.distributed.Group) -> None:
    for layer in layers:
        if "gate_proj" not in layer.mlp:  # mlx-lm's sparse-MoE block (Qwen3-VL-MoE)
            raise NotImplementedError(
                "tensor parallelism of the sparse-MoE layers is not supported; use --pipeline")
        shard_attention(layer.self_attn, group)
        shard_gated_mlp(layer.mlp, group)
