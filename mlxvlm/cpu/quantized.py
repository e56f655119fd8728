"""Quantized linear and embedding layers computed by mlxvlm's CPU kernel, on MLX's CPU
backend: the weights stay packed (4 or 8 bits), the maths is float32.

MLX's CPU ``quantized_matmul`` is many times slower than a float32 gemv of the same
shape, so without the kernels mlxvlm dequantizes quantized layers to float32 at load
(``fast_paths``), at 8x the memory of 4-bit weights. ``kernels.quantized_linear``
computes on the packed weights instead, at about the float32 gemv's speed, and exactly
the dequantized product (scale * q + bias in float32).

The layers are ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` subclasses with the
same parameters, so LoRA (QLoRA) wrapping and saving treat them as the layers they
replace. Affine 4- and 8-bit layers whose group size is a multiple of 8 qualify; others
keep ``fast_paths``' handling.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.cpu import kernels


def kernel_supports(layer: nn.Module) -> bool:
    return (
        isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and layer.mode == "affine"
        and layer.bits in kernels.QUANTIZED_BITS
        and layer.group_size % 8 == 0
        and layer.get("biases") is not None
        and layer.scales.dtype in (mx.float32, mx.bfloat16, mx.float16)
    )


def _copy_quantized(target: nn.Module, layer: nn.Module) -> None:
    nn.Module.__init__(target)
    target.group_size, target.bits, target.mode = layer.group_size, layer.bits, layer.mode
    target.weight, target.scales, target.biases = layer.weight, layer.scales, layer.biases


class CPUKernelQuantizedLinear(nn.QuantizedLinear):
    def __init__(self, layer: nn.QuantizedLinear):
        _copy_quantized(self, layer)
        if "bias" in layer:
            self.bias = layer.bias
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return kernels.quantized_linear(
            x, self.weight, self.scales, self.biases, group_size=self.group_size,
            bits=self.bits, bias=self.get("bias"),
        )


class CPUKernelQuantizedEmbedding(nn.QuantizedEmbedding):
    def __init__(self, layer: nn.QuantizedEmbedding):
        _copy_quantized(self, layer)
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        # float32 scales: the rows come out unrounded, as the linear kernel computes them
        return mx.dequantize(
            self.weight[x], scales=self.scales[x].astype(mx.float32),
            biases=self.biases[x].astype(mx.float32), group_size=self.group_size,
            bits=self.bits, mode=self.mode,
        )

    def as_linear(self, x: mx.array) -> mx.array:
        return kernels.quantized_linear(
            x, self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        )


def kernel_layer(layer: nn.Module) -> nn.Module:
    if isinstance(layer, nn.QuantizedEmbedding):
        return CPUKernelQuantizedEmbedding(layer)
    return CPUKernelQuantizedLinear(layer)
