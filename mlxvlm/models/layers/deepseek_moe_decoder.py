"""DeepSeek-MoE's text model with multi-head attention (DeepSeek-OCR's decoder, which
transformers writes as a DeepSeek-V2 without latent attention): mlx-lm's ``deepseek``
blocks -- Llama attention, a softmax router over routed experts plus always-on shared
experts, the first layers dense -- run from embeddings.

mlx-lm's ``deepseek.Model`` takes token ids only, so its blocks are run here under our
``TextDecoder`` (embeddings in, pipelining). Each block's kind comes from the config's
``mlp_layer_types`` ("dense" / "sparse"), transformers' field for it. Names:
``model.{embed_tokens,layers.N.{self_attn,mlp.{gate,switch_mlp,shared_experts}},norm}``,
``lm_head`` -- mlx-lm's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek
from mlx_lm.models.base import create_attention_mask

from mlxvlm.models.layers.blocks import TextDecoder


def model_args(text: dict, mlp_layer_types: list[str]) -> deepseek.ModelArgs:
    """mlx-lm's ``deepseek.ModelArgs`` from a transformers DeepSeek-OCR text config
    (standardized ``rope_parameters``), after refusing what mlx-lm's blocks do not
    compute: another router, scaled or group-limited routing, biased MLPs, scaled RoPE."""
    rope = dict(text["rope_parameters"])
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"DeepSeek-OCR text RoPE type {rope['rope_type']!r}")
    if text.get("topk_method", "greedy") != "greedy":
        raise NotImplementedError(f"DeepSeek-OCR expert routing {text['topk_method']!r}")
    if float(text.get("routed_scaling_factor", 1.0)) != 1.0:
        raise NotImplementedError("DeepSeek-OCR routed_scaling_factor other than 1.0")
    if text.get("mlp_bias") or text.get("hidden_act", "silu") != "silu":
        raise NotImplementedError("DeepSeek-OCR MLPs with biases or an activation other than SiLU")
    if set(mlp_layer_types) - {"dense", "sparse"}:
        raise ValueError(f"unknown mlp_layer_types {sorted(set(mlp_layer_types))}")
    fields = {f.name for f in dataclasses.fields(deepseek.ModelArgs)}
    values = {k: v for k, v in text.items() if k in fields and k not in ("rope_theta", "rope_scaling")}
    values.update(model_type="deepseek", rope_theta=float(rope["rope_theta"]), rope_scaling=None,
                  first_k_dense_replace=0, moe_layer_freq=1)
    return deepseek.ModelArgs(**values)


class Attention(deepseek.DeepseekAttention):
    """mlx-lm's attention under the head counts' names the tensor split reads and
    updates (``n_heads``, ``n_kv_heads``, as mlx-lm's Llama calls them)."""

    @property
    def n_heads(self) -> int:
        return self.num_attention_heads

    @n_heads.setter
    def n_heads(self, value: int) -> None:
        self.num_attention_heads = value

    @property
    def n_kv_heads(self) -> int:
        return self.num_kv_heads

    @n_kv_heads.setter
    def n_kv_heads(self, value: int) -> None:
        self.num_kv_heads = value


def decoder_layer(args: deepseek.ModelArgs, index: int) -> nn.Module:
    layer = deepseek.DeepseekDecoderLayer(args, index)
    layer.self_attn = Attention(args)
    return layer


class DeepseekMoeDecoder(TextDecoder):
    """Pipelined, it runs its own layers between ``receive`` and ``hand_on``."""

    runs_pipelined = True

    def __init__(self, args: deepseek.ModelArgs, mlp_layer_types: list[str]):
        dense = dataclasses.replace(args, n_routed_experts=None)
        layers = [decoder_layer(args if kind == "sparse" else dense, i)
                  for i, kind in enumerate(mlp_layer_types)]
        super().__init__(args.vocab_size, args.hidden_size, layers,
                         nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps))

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None,
                 embeddings: mx.array | None = None) -> mx.array:
        h, cache = self.start(inputs, cache, embeddings)
        mask = create_attention_mask(h, cache[0])
        h = self.receive(h)
        for layer, layer_cache in zip(self.pipeline_layers, cache):
            h = layer(h, mask, layer_cache)
        return self.norm(self.hand_on(h, cache))


class DeepseekMoeLanguageModel(nn.Module):
    """The decoder and its (untied) output head."""

    def __init__(self, args: deepseek.ModelArgs, mlp_layer_types: list[str]):
        super().__init__()
        self.model = DeepseekMoeDecoder(args, mlp_layer_types)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list:
        return self.model.layers

    def __call__(self, inputs, cache=None, embeddings=None, last_only: bool = False) -> mx.array:
        h = self.model(inputs, cache, embeddings)
        return self.lm_head(h[:, -1:] if last_only else h)


def split_experts(weights: dict[str, mx.array], prefix: str, moe_intermediate_size: int) -> None:
    """transformers 5's fused experts under ``prefix`` (``...mlp.experts.gate_up_proj``:
    (experts, 2 x width, hidden); ``...mlp.experts.down_proj``) as mlx-lm's
    ``switch_mlp`` tensors, in place; also the Hub's one tensor per expert
    (``...mlp.experts.E.gate_proj.weight``), stacked."""
    for name in [n for n in weights if n.startswith(prefix)]:
        if name.endswith(".mlp.experts.gate_up_proj"):
            fused = weights.pop(name)
            base = name[: -len("experts.gate_up_proj")]
            weights[base + "switch_mlp.gate_proj.weight"] = fused[:, :moe_intermediate_size]
            weights[base + "switch_mlp.up_proj.weight"] = fused[:, moe_intermediate_size:]
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[: -len("experts.down_proj")]
            weights[base + "switch_mlp.down_proj.weight"] = weights.pop(name)
    per_expert: dict[str, dict[int, mx.array]] = {}
    for name in [n for n in weights if n.startswith(prefix) and ".mlp.experts." in n]:
        base, rest = name.split(".mlp.experts.", 1)
        expert, projection = rest.split(".", 1)  # "E", "gate_proj.weight"
        key = f"{base}.mlp.switch_mlp.{projection}"
        per_expert.setdefault(key, {})[int(expert)] = weights.pop(name)
    for key, experts in per_expert.items():
        weights[key] = mx.stack([experts[e] for e in sorted(experts)])
