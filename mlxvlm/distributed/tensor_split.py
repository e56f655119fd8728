"""Tensor parallelism of any family's decoder blocks, found by what they hold rather than
by family: every rank keeps a 1/N slice of each attention's heads (self-attention, and
cross-attention to an image's states: Llama 3.2 Vision), of each MLP's hidden width (a
fused gate/up projection, GLM-4's, split as its two halves, each rank taking its slice of
each), of each expert's matrices and of each Gated DeltaNet's heads, and the slices'
partial outputs are all-reduced where the block's output leaves them.

The slicing is mlx.nn's (``shard_linear``: the sharded linear layers, quantized ones
too, whose all-reduce is in them; ``shard_inplace`` where the block reduces itself), as
mlx-lm's models' ``shard`` methods use it; mlx-lm's MoE and Gated DeltaNet blocks reduce
their own output once given a ``sharding_group`` (they declare one, None, when built).
What no block here reduces itself (an expert module followed by a norm: Gemma 4; a
sparse-MoE block that declares no ``sharding_group``: mlx-lm's DeepSeek-MoE) is wrapped
in ``AllSummed``.

Fewer key/value heads than ranks (or a count the ranks do not divide): each key/value
head is repeated, as vLLM does, until the ranks divide them and every rank's query heads
find theirs among its own. Query heads the ranks do not divide cannot be split:
``problems`` says so, with advice, before any weight is read.

Parts left whole on every rank, because splitting them would change their maths or their
state's shape: Gemma 3n's MLPs with activation sparsity (a statistic over the whole hidden
width), LFM2's short convolutions (their state is sized by the full hidden width), the
embeddings and output head, norms, routers.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear

# A layer holds one of these (Llama 3.2 Vision's cross-attention layers: cross_attn).
ATTENTION_NAMES = ("self_attn", "attention", "cross_attn")
MLP_NAMES = ("mlp", "feed_forward")
# (gate, up, down) projection names of the gated MLPs: Llama's and LFM2's.
GATED_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# GLM-4's MLP: gate and up fused in one projection, [gate | up] along its outputs.
FUSED_MLP_NAMES = ("gate_up_proj", "down_proj")
# Shared experts beside a sparse-MoE block's routed ones: Qwen's one, GLM-4.5's several.
SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts")


class AllSummed(nn.Module):
    """``inner``'s output summed over the group: for a module whose last projections
    were sharded in place (each rank's output a partial sum)."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.inner = inner
        self.group = group

    def __call__(self, *args, **kwargs):
        return mx.distributed.all_sum(self.inner(*args, **kwargs), group=self.group)


def kv_repeats(n_heads: int, n_kv_heads: int, size: int) -> int | None:
    """How many copies of each key/value head let ``size`` ranks split the heads (1 when
    they divide already); None when no number of copies does (query heads the ranks do
    not divide)."""
    if n_heads % size:
        return None
    for repeats in range(1, size + 1):
        kv = n_kv_heads * repeats
        if kv % size == 0 and n_heads % kv == 0:
            return repeats
    return None


def _attention(layer: nn.Module) -> nn.Module | None:
    for name in ATTENTION_NAMES:
        if name in layer and "q_proj" in layer[name]:
            return layer[name]
    return None


def _gated_mlp_names(mlp: nn.Module) -> tuple[str, str, str] | None:
    return next((names for names in GATED_MLP_NAMES if all(n in mlp for n in names)), None)


def _fused_mlp(mlp: nn.Module) -> bool:
    return all(name in mlp for name in FUSED_MLP_NAMES)


def _mlp_width(mlp: nn.Module) -> int | None:
    """The hidden width a gated MLP (fused or not) splits, or None for another MLP."""
    if _fused_mlp(mlp):
        return mlp.gate_up_proj.weight.shape[0] // 2
    names = _gated_mlp_names(mlp)
    return None if names is None else mlp[names[0]].weight.shape[0]


def _mlp_name(layer: nn.Module) -> str | None:
    return next((name for name in MLP_NAMES if name in layer), None)


def _mlp(layer: nn.Module) -> nn.Module | None:
    name = _mlp_name(layer)
    return None if name is None else layer[name]


def problems(layers: list, size: int) -> str | None:
    """Why ``layers`` cannot be split over ``size`` ranks (one clause), or None."""
    for index, layer in enumerate(layers):
        attention = _attention(layer)
        if attention is not None:
            heads, kv = attention.n_heads, attention.n_kv_heads
            if kv_repeats(heads, kv, size) is None:
                return (f"layer {index}'s {heads} attention heads do not split over {size} "
                        "ranks")
        linear = layer["linear_attn"] if "linear_attn" in layer else None
        if linear is not None:
            k, v = linear.num_k_heads, linear.num_v_heads
            if k % size or v % size:
                return (f"layer {index}'s {k} key and {v} value Gated DeltaNet heads do not "
                        f"split over {size} ranks")
        mlp = _mlp(layer)
        widths = [] if mlp is None or not _splits_mlp(mlp) else [
            _mlp_width(m) for m in (mlp, *_shared_experts(mlp))]
        for width in widths:
            if width is not None and width % size:
                return f"layer {index}'s MLP width {width} does not split over {size} ranks"
        for switch in _switch_glus(layer):
            width = switch.gate_proj.weight.shape[-2]  # (experts, width, input)
            if width % size:
                return (f"layer {index}'s expert width {width} does not split over {size} "
                        "ranks")
    return None


def _switch_glus(layer: nn.Module) -> list[nn.Module]:
    """The layer's expert banks: mlx-lm's sparse-MoE ``switch_mlp``, Gemma 4's
    ``experts.switch_glu``."""
    mlp = _mlp(layer)
    banks = [mlp.switch_mlp] if mlp is not None and "switch_mlp" in mlp else []
    if "experts" in layer and "switch_glu" in layer.experts:
        banks.append(layer.experts.switch_glu)
    return banks


def _shared_experts(mlp: nn.Module) -> list[nn.Module]:
    return [mlp[name] for name in SHARED_EXPERT_NAMES if name in mlp]


def _splits_mlp(mlp: nn.Module) -> bool:
    # Gemma 3n's sparse activation keeps a statistic over the whole hidden width.
    return not getattr(mlp, "activation_sparsity", 0.0)


def _repeat_heads(linear: nn.Module, heads: int, repeats: int) -> None:
    """Each of ``linear``'s ``heads`` output blocks (rows, and their scales, biases and
    bias) ``repeats`` times, in place."""

    def repeat(p: mx.array) -> mx.array:
        p = p.reshape(heads, p.shape[0] // heads, *p.shape[1:])
        return mx.repeat(p, repeats, axis=0).reshape(-1, *p.shape[2:])

    linear.update({k: repeat(v) for k, v in linear.parameters().items()})


def split_attention(attention: nn.Module, group: mx.distributed.Group) -> None:
    """This rank's share of the heads: q/k/v split by output (k/v after repeating their
    heads if the ranks need it), the output projection by input and all-reduced.
    Per-head norms act per head: unchanged. Layers without k/v (Gemma's KV-shared
    layers) take the keys and values their source layer split the same way."""
    size = group.size()
    repeats = kv_repeats(attention.n_heads, attention.n_kv_heads, size)
    for name in ("q_proj", "k_proj", "v_proj"):
        if name not in attention:
            continue
        if name != "q_proj" and repeats > 1:
            _repeat_heads(attention[name], attention.n_kv_heads, repeats)
        attention[name] = shard_linear(attention[name], "all-to-sharded", group=group)
    out = "o_proj" if "o_proj" in attention else "out_proj"
    attention[out] = shard_linear(attention[out], "sharded-to-all", group=group)
    attention.n_heads //= size
    attention.n_kv_heads = attention.n_kv_heads * repeats // size
    if hasattr(attention, "repeats"):  # mlx-lm's Gemma attentions: query heads per kv head
        attention.repeats = attention.n_heads // attention.n_kv_heads


def split_gated_mlp(mlp: nn.Module, group: mx.distributed.Group) -> None:
    """gate/up split by output, down by input and all-reduced. A fused gate/up
    projection is split as its two halves: a rank's outputs are its slice of the gate's
    then its slice of the up's, which the MLP's own split in two pairs up again."""
    if _fused_mlp(mlp):
        mlp.gate_up_proj = shard_linear(mlp.gate_up_proj, "all-to-sharded", segments=2,
                                        group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
        return
    gate, up, down = _gated_mlp_names(mlp)
    mlp[gate] = shard_linear(mlp[gate], "all-to-sharded", group=group)
    mlp[up] = shard_linear(mlp[up], "all-to-sharded", group=group)
    mlp[down] = shard_linear(mlp[down], "sharded-to-all", group=group)


def _split_switch_glu(switch: nn.Module, group: mx.distributed.Group) -> None:
    """Every expert's matrices, split in place (the caller reduces the output)."""
    shard_inplace(switch.gate_proj, "all-to-sharded", group=group)
    shard_inplace(switch.up_proj, "all-to-sharded", group=group)
    shard_inplace(switch.down_proj, "sharded-to-all", group=group)


def _split_in_place_mlp(mlp: nn.Module, group: mx.distributed.Group) -> None:
    gate, up, down = _gated_mlp_names(mlp)
    shard_inplace(mlp[gate], "all-to-sharded", group=group)
    shard_inplace(mlp[up], "all-to-sharded", group=group)
    shard_inplace(mlp[down], "sharded-to-all", group=group)
    if "bias" in mlp[down] and group.rank() != 0:  # added once in the reduced sum
        mlp[down].bias = mx.zeros_like(mlp[down].bias)


def split_sparse_moe(block: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """mlx-lm's sparse-MoE blocks (Qwen3-MoE's, Qwen3-Next's, GLM-4.5's, DeepSeek-MoE's):
    each expert's matrices (and the shared experts') split in place; the router stays
    whole. Returns what the layer runs in the block's place: the block itself when it
    all-reduces its own output once given ``sharding_group`` (a block that can declares
    one); else the block in ``AllSummed``, since its output is only this rank's partial
    sum (mlx-lm's ``deepseek.DeepseekMoE`` has no reduction of its own)."""
    _split_switch_glu(block.switch_mlp, group)
    for shared in _shared_experts(block):
        _split_in_place_mlp(shared, group)
    if not hasattr(block, "sharding_group"):
        return AllSummed(block, group)
    block.sharding_group = group
    return block


def split_gated_delta_net(linear: nn.Module, group: mx.distributed.Group) -> None:
    """mlx-lm's Gated DeltaNet: this rank's 1/N of the key and value heads. The q/k/v
    projection and its convolution hold [q | k | v] channels, each part split by
    itself; the per-head gates and decays follow their heads; the block all-reduces its
    output projection once given ``sharding_group``."""
    size, rank = group.size(), group.rank()
    kd = linear.key_dim
    parts = lambda _path, _weight: (0, [kd, 2 * kd])  # noqa: E731  (q | k | v on axis 0)
    shard_inplace(linear.conv1d, parts, group=group)
    linear.conv1d.groups //= size
    shard_inplace(linear.in_proj_qkv, "all-to-sharded", segments=[kd, 2 * kd], group=group)
    for name in ("in_proj_z", "in_proj_b", "in_proj_a"):
        shard_inplace(linear[name], "all-to-sharded", group=group)
    linear.dt_bias = mx.contiguous(mx.split(linear.dt_bias, size)[rank])
    linear.A_log = mx.contiguous(mx.split(linear.A_log, size)[rank])
    shard_inplace(linear.out_proj, "sharded-to-all", group=group)
    for name in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"):
        setattr(linear, name, getattr(linear, name) // size)
    linear.sharding_group = group


def split_layers(layers: list, group: mx.distributed.Group) -> None:
    """Split every block of ``layers`` over ``group`` (``problems`` found none)."""
    for layer in layers:
        if layer is None:  # a pipeline rank's dropped layer
            continue
        attention = _attention(layer)
        if attention is not None:
            split_attention(attention, group)
        if "linear_attn" in layer:
            split_gated_delta_net(layer.linear_attn, group)
        mlp = _mlp(layer)
        if mlp is not None:
            if "switch_mlp" in mlp:
                layer[_mlp_name(layer)] = split_sparse_moe(mlp, group)
            elif _mlp_width(mlp) is not None and _splits_mlp(mlp):
                split_gated_mlp(mlp, group)
        if "experts" in layer and "switch_glu" in layer.experts:  # Gemma 4's experts
            _split_switch_glu(layer.experts.switch_glu, group)
            layer.experts = AllSummed(layer.experts, group)
