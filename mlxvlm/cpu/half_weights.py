"""Linear and embedding layers that keep a checkpoint's 16-bit weights and compute in
float32, on MLX's CPU backend.

MLX's bfloat16/float16 matmuls are several times slower than float32 ones on the CPU, so
mlxvlm computes in float32 there. Converting the weights to float32 doubled a bf16
checkpoint's memory; with ``kernels.half_linear`` the weights of every linear and
embedding layer stay 16-bit (decode reads half the bytes, prefill converts them a chunk
at a time) and only the small rest of the model (norms, biases, convolutions) is float32.

Mixture-of-experts banks (mlx-lm's ``SwitchLinear``: Qwen3-MoE, Qwen3.5-MoE, GLM-4.5's,
DeepSeek-MoE's experts, Qwen3-Omni's talker) are most of an MoE checkpoint's bytes; they
stay 16-bit too, and each call reads only the experts its rows chose
(``kernels.gathered_half_linear``).

The layers are ``nn.Linear`` / ``nn.Embedding`` / ``SwitchLinear`` subclasses with the
same parameters, so LoRA wrapping, adapters and saving treat them as the layers they
replace. A tensor-parallel
rank's sharded linear layers (mlx.nn's ``AllToShardedLinear`` / ``ShardedToAllLinear``)
keep their 16-bit slices the same way, and its quantized sharded layers their 16-bit
scales: a rank holds its share of the checkpoint's bytes, as one process holds all of
them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchLinear

from mlxvlm.cpu import kernels

HALF_DTYPES = (mx.bfloat16, mx.float16)


class CPUHalfLinear(nn.Linear):
    """``nn.Linear`` with a bfloat16/float16 weight, computed in float32.

    A model may replace the weight itself (mlx-lm's Gemma 3n AltUp sets its coefficient
    layers' weights to a float32 copy on every call): such a layer then computes as the
    plain ``nn.Linear`` it is."""

    def __init__(self, layer: nn.Linear):
        nn.Module.__init__(self)
        self.weight = layer.weight
        if "bias" in layer:
            self.bias = layer.bias.astype(mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        if self.weight.dtype not in HALF_DTYPES:  # rewritten by its model (see above)
            return super().__call__(x)
        return kernels.half_linear(x, self.weight, self.get("bias"))

    def add_to(self, residual: mx.array, x: mx.array) -> mx.array:
        """``residual + self(x)``, the residual summed in the product's own output pass
        (and its buffer reused for the output when nothing else holds it)."""
        if self.weight.dtype not in HALF_DTYPES:
            return residual + super().__call__(x)
        return kernels.half_linear(x, self.weight, self.get("bias"), residual)


def _adopt_slice(twin: nn.Module, layer: nn.Module) -> None:
    """A sharded layer's group and 16-bit weight slice, its bias in float32."""
    twin.group = layer.group
    twin.weight = layer.weight
    if "bias" in layer:
        twin.bias = layer.bias.astype(mx.float32)


class CPUHalfAllToShardedLinear(AllToShardedLinear):
    """mlx.nn's ``AllToShardedLinear`` with a 16-bit weight slice, computed in float32."""

    def __init__(self, layer: AllToShardedLinear):
        nn.Module.__init__(self)
        _adopt_slice(self, layer)

    def __call__(self, x: mx.array) -> mx.array:
        return kernels.half_linear(x, self.weight, self.get("bias"))


class CPUHalfShardedToAllLinear(ShardedToAllLinear):
    """mlx.nn's ``ShardedToAllLinear`` with a 16-bit weight slice, computed in float32:
    this rank's partial product, summed over the group, then the bias."""

    def __init__(self, layer: ShardedToAllLinear):
        nn.Module.__init__(self)
        _adopt_slice(self, layer)

    def __call__(self, x: mx.array) -> mx.array:
        x = mx.distributed.all_sum(kernels.half_linear(x, self.weight), group=self.group)
        return x + self["bias"] if "bias" in self else x


def residual_plus(residual: mx.array, layer: nn.Module, x: mx.array) -> mx.array:
    """``residual + layer(x)``: one operation where the layer can add the residual itself
    (``CPUHalfLinear``), MLX's addition otherwise (float32, quantized or LoRA layers)."""
    add_to = getattr(layer, "add_to", None)
    return add_to(residual, x) if add_to is not None else residual + layer(x)


class CPUHalfEmbedding(nn.Embedding):
    """``nn.Embedding`` with a bfloat16/float16 table: rows and tied outputs in float32."""

    def __init__(self, layer: nn.Embedding):
        nn.Module.__init__(self)
        self.weight = layer.weight

    def __call__(self, x: mx.array) -> mx.array:
        return self.weight[x].astype(mx.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        return kernels.half_linear(x, self.weight)


class CPUHalfSwitchLinear(SwitchLinear):
    """mlx-lm's ``SwitchLinear`` (a bank of expert matrices, (experts, out, in)) with a
    bfloat16/float16 bank, computed in float32: each row is multiplied by its own expert's
    16-bit matrix, read as it is (no float32 copy of the bank, nor of the chosen experts).
    A tensor-parallel rank's bank (its slice of every expert, split in place) is one too."""

    def __init__(self, layer: SwitchLinear):
        nn.Module.__init__(self)
        self.weight = layer.weight
        if "bias" in layer:
            self.bias = layer.bias.astype(mx.float32)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if self.weight.dtype not in HALF_DTYPES:  # rewritten by its model
            return super().__call__(x, indices, sorted_indices)
        # gather_mm's broadcasting: x (..., M, K) against indices (...), each of an expert's
        # products over M rows; the kernel takes one expert per row. (The order of the rows
        # does not matter to it: it groups them by expert itself.)
        batch = mx.broadcast_shapes(x.shape[:-2], indices.shape)
        rows, K = x.shape[-2:]
        x = mx.broadcast_to(x, (*batch, rows, K))
        experts = mx.broadcast_to(mx.expand_dims(mx.broadcast_to(indices, batch), -1),
                                  (*batch, rows))
        y = kernels.gathered_half_linear(x, self.weight, experts)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


# layer type -> its 16-bit-weight, float32-computing replacement
_HALF_LAYERS = {
    nn.Linear: CPUHalfLinear,
    nn.Embedding: CPUHalfEmbedding,
    AllToShardedLinear: CPUHalfAllToShardedLinear,
    ShardedToAllLinear: CPUHalfShardedToAllLinear,
    SwitchLinear: CPUHalfSwitchLinear,
}
_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedAllToShardedLinear,
              QuantizedShardedToAllLinear)


def _half_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if type(m) in _HALF_LAYERS and m.weight.dtype in HALF_DTYPES
    ]


def cast_to_float32_keeping_half_weights(model: nn.Module) -> None:
    """Float32 for every floating parameter except the 16-bit weights of linear and
    embedding layers and of expert banks (which ``use_half_weight_layers`` then computes
    with)."""
    prefix = lambda name: f"{name}." if name else ""  # noqa: E731
    kept = {f"{prefix(name)}weight" for name, _ in _half_layers(model)}
    # Quantized layers' 16-bit scales and biases too: the quantized kernel reads them as
    # they are (``quantized``), and dequantizing casts them (``fast_paths``).
    kept |= {
        f"{prefix(name)}{part}"
        for name, m in model.named_modules()
        if isinstance(m, _QUANTIZED)
        for part in ("scales", "biases")
    }
    updates = [
        (path, value.astype(mx.float32))
        for path, value in tree_flatten(model.parameters())
        if path not in kept and mx.issubdtype(value.dtype, mx.floating)
        and value.dtype != mx.float32
    ]
    if updates:
        model.update(tree_unflatten(updates))


def use_half_weight_layers(model: nn.Module) -> tuple[int, int]:
    """Swap the linear/embedding layers and expert banks with 16-bit weights for the
    float32-computing ones above, in place. Returns (layers swapped, bytes of their weights)."""
    layers = _half_layers(model)
    replacements = [(name, _HALF_LAYERS[type(m)](m)) for name, m in layers]
    if replacements:
        model.update_modules(tree_unflatten(replacements))
    return len(layers), sum(m.weight.nbytes for _, m in layers)
