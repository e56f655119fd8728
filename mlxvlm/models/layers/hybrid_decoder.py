"""The Qwen3.5 text decoder: Gated DeltaNet linear-attention layers mixed with gated
full-attention layers (three linear layers to one full one in the released models),
under interleaved M-RoPE.

- A linear layer (mlx-lm's ``GatedDeltaNet``, the same maths as transformers') keeps a
  fixed-size state per sequence: a short convolution window over its q/k/v projections
  and the delta rule's recurrent matrix. Its cache is mlx-lm's ``ArraysCache`` (two
  arrays); it cannot be trimmed, only replaced by a snapshot taken at the length wanted.
- A full-attention layer is Qwen3-Next's: per-head RMSNorm on queries and keys, the query
  projection twice as wide so that its second half gates the attention output through a
  sigmoid, and rotary embedding on the first ``partial_rotary_factor`` of each head only.
  The rotation is M-RoPE's (``layers/mrope_decoder.py``): interleaved sections over time,
  height and width, positions from the request's ``MRopeState``.

mlx-lm's own ``qwen3_5`` text model rotates with plain RoPE from the cache offset, which
equals M-RoPE only for text; so the attention and the decoder loop are written here and
everything else (linear layer, MLP, sparse MoE block) is mlx-lm's.

Positions are absolute: the decoder reads its offset from the first attention layer's
cache (linear-state caches count no tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.qwen3_5 import GatedDeltaNet
from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock

from mlxvlm.cpu.ops import cached_attention
from mlxvlm.models.layers.mrope_decoder import (
    LanguageModel,
    MRopeDecoder,
    MRopeState,
)
from mlxvlm.models.layers.rotary import apply_rotary

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class HybridTextConfig:
    """The decoder's switches; field names are mlx-lm's, whose layers read them."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    linear_num_value_heads: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    attention_bias: bool = False
    # Sparse MoE MLP in every layer (Qwen3.5-MoE); num_experts 0: dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Layers of the multi-token-prediction head (``layers/mtp_head.py``); 0: none.
    mtp_num_hidden_layers: int = 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel by the query projection's second
    half, rotated on the first ``rotary_dim`` channels of each head."""

    def __init__(self, config: HybridTextConfig):
        super().__init__()
        dim, head_dim = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.rotary_dim = config.rotary_dim
        self.scale = head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)

    def rotate(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        r = self.rotary_dim
        return mx.concatenate([apply_rotary(x[..., :r], cos, sin), x[..., r:]], axis=-1)

    def __call__(self, x, rotary, mask, cache=None) -> mx.array:
        B, L, _ = x.shape
        queries, gate = mx.split(self.q_proj(x).reshape(B, L, self.n_heads, -1), 2, axis=-1)
        queries = self.q_norm(queries)
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1))
        cos, sin = rotary
        queries = self.rotate(queries, cos, sin).transpose(0, 2, 1, 3)
        keys = self.rotate(keys, cos, sin).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = cached_attention(queries, keys, values, cache, scale=self.scale, mask=mask)
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output * mx.sigmoid(gate.reshape(B, L, -1)))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: HybridTextConfig, index: int):
        super().__init__()
        self.is_linear = config.layer_types[index] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        if config.num_experts:
            self.mlp = Qwen3NextSparseMoeBlock(config)
        else:
            self.mlp = Qwen3NextMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, rotary, masks, cache=None) -> mx.array:
        linear_mask, attention_mask = masks
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, linear_mask, cache)
        else:
            h = self.self_attn(h, rotary, attention_mask, cache)
        h = x + h
        return h + self.mlp(self.post_attention_layernorm(h))


def _first(layer_types, kind: str) -> int | None:
    return next((i for i, t in enumerate(layer_types) if t == kind), None)


class HybridMRopeModel(MRopeDecoder):
    layer_class = HybridDecoderLayer

    runs_pipelined = True

    def __init__(self, config: HybridTextConfig):
        super().__init__(config, config.rotary_dim, interleaved=True)
        if _first(config.layer_types, FULL) is None:
            raise ValueError("a Qwen3.5 decoder needs at least one full_attention layer")

    def make_cache(self) -> list[Any]:
        return [ArraysCache(size=2) if layer.is_linear else KVCache()
                for layer in self.pipeline_layers]

    def __call__(self, inputs, cache=None, embeddings=None, state: MRopeState | None = None):
        # Pipelined, this rank's run of layers (and their caches, from make_cache) between
        # receive and hand_on; a run may hold no attention layer (no positions needed)
        # or no linear one.
        h, cache = self.start(inputs, cache, embeddings)
        kinds = [LINEAR if layer.is_linear else FULL for layer in self.pipeline_layers]
        first_attention, first_linear = _first(kinds, FULL), _first(kinds, LINEAR)
        attention_cache = cache[first_attention] if first_attention is not None else None
        offset = attention_cache.offset if attention_cache is not None else 0
        rotary = self.rotary.for_tokens(state, offset, h.shape[1], h.dtype)
        linear_cache = cache[first_linear] if first_linear is not None else None
        masks = (create_ssm_mask(h, linear_cache), create_attention_mask(h, attention_cache))
        h = self.receive(h)
        for layer, layer_cache in zip(self.pipeline_layers, cache):
            h = layer(h, rotary, masks, layer_cache)
        return self.norm(self.hand_on(h, cache))


class HybridLanguageModel(LanguageModel):
    """``language_model`` in checkpoints: the hybrid decoder plus its output head."""

    decoder_class = HybridMRopeModel
