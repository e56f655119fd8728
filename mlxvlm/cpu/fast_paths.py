"""A loaded model rewritten for MLX's CPU backend: 16-bit and quantized layers, norms,
rotary embeddings, and mlx-lm text models' maths.

MLX's CPU ``quantized_matmul`` costs about as much per row as dequantizing the whole
matrix (benchmarks/README.md has the figures). With mlxvlm's CPU kernels built, affine
4/8-bit layers run on ``kernels.quantized_linear`` and stay quantized (``quantized``).
Other quantized layers, or all of them without the kernels:

- if the model's quantized layers fit in memory as float32 (within a budget: half of the
  machine's RAM by default, ``MLXVLM_CPU_DEQUANTIZE_MAX_GB`` to change it), they are
  dequantized once at load and run as plain float32 layers through BLAS — the fastest
  decode and prefill there is;
- otherwise they stay quantized, and a product over more than one row (prefill, batched
  decode) dequantizes the layer's weight for that call and uses BLAS, while a single row
  (decode) uses the quantized kernel. Memory stays at the quantized size plus one layer.

With the kernels built (they need a C++ compiler), a bfloat16/float16 checkpoint's
linear and embedding weights stay 16-bit and are computed in float32 (``half_weights``):
half the memory of float32 weights, and decoding reads half the bytes. Layers dequantized
at load are float32 (``scale * q + bias`` in float32, exactly what the quantized kernels
compute; 16 bits would round it). The kernels also take the model's LayerNorm/RMSNorm
layers (``norms``) and its rotary embeddings (``rope``): each one operation where MLX's
CPU backend composes many, which is what a decoding step's time goes to (dispatch, not
arithmetic).

It also gives the text models from mlx-lm the exp-based maths of ``fast_math`` and the
blocked attention of ``attention`` (see ``mlx_lm``); the vision towers and mlxvlm's own
decoders reach those through ``ops``.

Metal (and CUDA) keep MLX's own kernels: nothing here runs off the CPU backend
(``policy.fast_paths_enabled``). ``MLXVLM_NO_CPU_FAST_PATHS=1`` turns all of this off;
``load(..., cpu_fast_paths=False)`` leaves the model's modules as they are (fine-tuning
does).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxvlm.cpu import kernels, policy


@dataclass
class FastPathReport:
    """What ``apply_cpu_fast_paths`` did, for ``--verbose``."""

    kernel_quantized: int = 0  # layers kept quantized, on mlxvlm's quantized kernel
    dequantized: int = 0  # layers turned into float32 layers
    dequantized_bytes: int = 0
    half_layers: int = 0  # linear/embedding layers computing in float32 on 16-bit weights
    half_bytes: int = 0
    kernel_norms: int = 0  # LayerNorm/RMSNorm layers on mlxvlm's norm kernel
    kernel_ropes: int = 0  # rotary modules on mlxvlm's rope kernel
    streamed: int = 0  # layers kept quantized, dequantized per multi-row call
    fast_mlps: int = 0  # mlx-lm MLPs given fast_math's activation
    reason: str = ""

    def describe(self) -> str:
        if self.reason:
            return self.reason
        maths = "softmax, GELU and SiLU on a vectorised exp, blocked attention"
        if self.fast_mlps:
            maths += f" ({self.fast_mlps} mlx-lm MLPs)"
        if self.kernel_norms:
            maths += f"; {self.kernel_norms} norm layers on the CPU kernel"
        if self.kernel_ropes:
            maths += f"; {self.kernel_ropes} rotary embeddings on the CPU kernel"
        parts = [self._describe_quantized(), maths]
        if self.half_layers:
            parts.insert(0, f"{self.half_layers} layers keep 16-bit weights "
                            f"({self.half_bytes / 1e9:.2f} GB), computed in float32")
        return "; ".join(parts)

    def _describe_quantized(self) -> str:
        parts = []
        if self.kernel_quantized:
            parts.append(f"{self.kernel_quantized} quantized layers computed on their packed "
                         "weights (CPU kernel)")
        if self.dequantized:
            gb = self.dequantized_bytes / 1e9
            parts.append(f"{self.dequantized} quantized layers dequantized to float32 ({gb:.2f} GB)")
        if self.streamed:
            parts.append(f"{self.streamed} quantized layers kept quantized (float32 would exceed "
                         "the budget); multi-row products dequantize per layer")
        return "; ".join(parts) or "no quantized layers"


def keeps_half_weights() -> bool:
    """Whether 16-bit weights stay 16-bit here (the CPU backend, with the kernels)."""
    return kernels.enabled()


def _float32(a):
    """Float scales/biases in float32 (mx.dequantize returns their dtype: 16-bit ones would
    round the weights); the mx/nv fp formats' integer scales as they are."""
    return a.astype(mx.float32) if a is not None and mx.issubdtype(a.dtype, mx.floating) else a


def _dequantized_weight(layer: nn.Module) -> mx.array:
    return mx.dequantize(
        layer.weight,
        _float32(layer.scales),
        _float32(layer.get("biases")),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    ).astype(mx.float32)


class CPUQuantizedLinear(nn.QuantizedLinear):
    """A quantized linear layer that uses BLAS for products over several rows.

    A QuantizedLinear (LoRA wrapping, fusing and saving treat it as one), built from an
    existing layer without re-quantizing anything.
    """

    def __init__(self, layer: nn.QuantizedLinear):
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        self.weight, self.scales = layer.weight, layer.scales
        if "biases" in layer:
            self.biases = layer.biases
        if "bias" in layer:
            self.bias = layer.bias
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows > 1:
            y = x @ _dequantized_weight(self).T
        else:
            y = mx.quantized_matmul(
                x,
                self.weight,
                self.scales,
                self.get("biases"),
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
            )
        if "bias" in self:
            y = y + self.bias
        return y


def _as_float_module(layer: nn.Module) -> nn.Module:
    weight = _dequantized_weight(layer)
    if isinstance(layer, nn.QuantizedEmbedding):
        module = nn.Embedding(*weight.shape)
        module.weight = weight
        return module
    module = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in layer)
    module.weight = weight
    if "bias" in layer:
        module.bias = layer.bias.astype(mx.float32)
    return module


def apply_cpu_fast_paths(model: nn.Module) -> FastPathReport:
    """Rewrite the model for the CPU backend, in place: mlx-lm MLPs and attention onto the
    fast maths, quantized layers onto BLAS (see the module docstring)."""
    if not policy.fast_paths_enabled():
        return FastPathReport(reason="off (not on the CPU backend, or disabled)")
    from mlxvlm.cpu.mlx_lm import use_fast_attention, use_fast_mlps

    fast_mlps = use_fast_mlps(model)
    use_fast_attention(model)
    report = _apply_quantized_fast_paths(model)
    report.fast_mlps = fast_mlps
    if keeps_half_weights():
        from mlxvlm.cpu.half_weights import use_half_weight_layers
        from mlxvlm.cpu.norms import use_cpu_norms
        from mlxvlm.cpu.rope import use_cpu_rope

        report.half_layers, report.half_bytes = use_half_weight_layers(model)
        report.kernel_norms = use_cpu_norms(model)
        report.kernel_ropes = use_cpu_rope(model)
    return report


def _apply_quantized_fast_paths(model: nn.Module) -> FastPathReport:
    quantized = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    ]
    if not quantized:
        return FastPathReport()
    report = FastPathReport()
    replacements = []
    if keeps_half_weights():  # the kernels are here: supported layers stay quantized
        from mlxvlm.cpu.quantized import kernel_layer, kernel_supports

        for name, layer in quantized:
            if kernel_supports(layer):
                replacements.append((name, kernel_layer(layer)))
        report.kernel_quantized = len(replacements)
        quantized = [(n, m) for n, m in quantized if not kernel_supports(m)]
    float_bytes = sum(
        m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits * 4 for _, m in quantized
    )
    if quantized and float_bytes <= policy.dequantize_budget_bytes():
        for name, layer in quantized:
            replacements.append((name, _as_float_module(layer)))
        report.dequantized, report.dequantized_bytes = len(quantized), float_bytes
    elif quantized:
        streamed = [(n, CPUQuantizedLinear(m)) for n, m in quantized
                    if isinstance(m, nn.QuantizedLinear)]
        replacements += streamed
        report.streamed = len(streamed)
    model.update_modules(tree_unflatten(replacements))
    mx.eval(model.parameters())
    return report


def stream_quantized_layers(model: nn.Module) -> None:
    """For training on a quantized base (QLoRA) on the CPU backend: each plain quantized
    linear layer becomes a ``CPUQuantizedLinear`` (BLAS for many rows, still holding only
    the quantized weights). Nothing changes elsewhere."""
    if policy.fast_paths_enabled():
        model.update_modules(tree_unflatten([
            (name, CPUQuantizedLinear(m)) for name, m in model.named_modules()
            if type(m) is nn.QuantizedLinear
        ]))
