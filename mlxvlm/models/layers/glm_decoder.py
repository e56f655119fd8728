"""The GLM-V text decoders: GLM-4's blocks under multimodal RoPE (M-RoPE) that turns only
part of each head.

Both run in the M-RoPE decoder's loop (``mrope_decoder.Qwen2MRopeModel``: positions from
the request's ``MRopeState``, chunked prefill, pipelining) with the rotary tables over
``head_dim * partial_rotary_factor`` dimensions, in blocked t/h/w sections; the rest of
each head passes unturned. They differ in how a head is turned and in their blocks:

- GLM-4.1V / GLM-4.6V-Flash (``glm4v``, dense): adjacent pairs of the turned dimensions
  rotate together (each frequency repeated twice, ``rotate_pairs``), and every block is
  GLM-4's: a norm after attention and after the MLP besides the two before them, the MLP
  gate and up projections fused (mlx-lm's ``glm4.Glm4MLP``).
- GLM-4.5V / GLM-4.6V (``glm4v_moe``): the usual halves rotate (as Qwen's), blocks are
  GLM-4.5's: the first ``first_k_dense_replace`` dense, the others mixtures of experts
  with a sigmoid router, its score-correction bias and shared experts (mlx-lm's
  ``glm4_moe.MoE`` and ``MLP``).

GLM-OCR's decoder is the dense one with ``attention_bias`` off.

Checkpoint names (mlx-community's): ``layers.N.self_attn.{q,k,v,o}_proj``,
``layers.N.mlp.gate_up_proj`` / ``down_proj`` (dense), ``layers.N.mlp.gate`` (its
``weight`` and ``e_score_correction_bias``), ``layers.N.mlp.switch_mlp.*``,
``layers.N.mlp.shared_experts.*``, and the norms named as in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.glm4 import Glm4MLP
from mlx_lm.models.glm4_moe import MLP as Glm4MoeMLP
from mlx_lm.models.glm4_moe import MoE

from mlxvlm.cpu.ops import cached_attention
from mlxvlm.models.config_utils import text_config
from mlxvlm.models.layers.mrope_decoder import LanguageModel, MRopeDecoder, Qwen2MRopeModel, default_mrope
from mlxvlm.models.layers.rotary import apply_rotary


@dataclass
class GlmTextConfig:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    partial_rotary_factor: float = 0.5
    explicit_head_dim: int | None = None
    attention_bias: bool = True
    # True: adjacent pairs turn together (dense GLM-4V); False: halves (GLM-4.5V MoE)
    rotate_pairs: bool = True
    # Mixture of experts (GLM-4.5V / GLM-4.6V); n_routed_experts 0: dense blocks (GLM-4 style)
    n_routed_experts: int = 0
    n_shared_experts: int | None = None
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"  # mlx-lm's MoEGate checks it

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_experts(self) -> int:  # the name qwen3_vl_moe.split_experts reads
        return self.n_routed_experts

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @classmethod
    def from_hf(cls, config: dict, *, moe: bool, **switches) -> "GlmTextConfig":
        """From either config layout; defaults are transformers' Glm4vTextConfig's
        (``moe``: Glm4vMoeTextConfig's)."""
        text = text_config(config, 10000.0)
        rope = default_mrope(text, "GLM-V")
        heads = text.get("num_attention_heads", 96 if moe else 32)
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
        moe_fields = {}
        if moe:
            experts = text.get("n_routed_experts") or text.get("num_local_experts") or 0
            if not experts:
                raise ValueError(f"a {config.get('model_type')} config must set n_routed_experts")
            moe_fields = dict(
                n_routed_experts=experts,
                n_shared_experts=text.get("n_shared_experts", 1),
                num_experts_per_tok=text.get("num_experts_per_tok", 8),
                moe_intermediate_size=text.get("moe_intermediate_size", 1408),
                first_k_dense_replace=text.get("first_k_dense_replace", 1),
                norm_topk_prob=text.get("norm_topk_prob", True),
                routed_scaling_factor=text.get("routed_scaling_factor", 1.0),
                n_group=text.get("n_group", 1),
                topk_group=text.get("topk_group", 1),
            )
        fields = dict(
            hidden_size=text.get("hidden_size", 4096),
            num_hidden_layers=text.get("num_hidden_layers", 46 if moe else 40),
            intermediate_size=text.get("intermediate_size", 10944 if moe else 13696),
            num_attention_heads=heads,
            num_key_value_heads=text.get("num_key_value_heads") or (8 if moe else 2),
            vocab_size=text.get("vocab_size", 151424 if moe else 151552),
            rms_norm_eps=text.get("rms_norm_eps", 1e-5),
            rope_theta=rope["rope_theta"],
            mrope_section=tuple(rope.get("mrope_section", (8, 12, 12))),
            max_position_embeddings=text.get("max_position_embeddings", 65536 if moe else 32768),
            tie_word_embeddings=text["tie_word_embeddings"],
            # the dense config's rope defaults to the whole head, the MoE one's to half
            partial_rotary_factor=float(partial if partial is not None else (0.5 if moe else 1.0)),
            explicit_head_dim=text.get("head_dim") if moe else None,
            attention_bias=bool(text.get("attention_bias", True)),
            rotate_pairs=not moe,
            **moe_fields,
        )
        # a relative's own reading (GLM-OCR: no attention biases, its head size)
        return cls(**{**fields, **switches})


def rotate_pairs(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Adjacent pairs (x0, x1) of ``x`` turned by one angle each: ``cos``/``sin`` hold
    one value per pair."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    turned = mx.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return turned.reshape(x.shape).astype(x.dtype)


class GlmAttention(nn.Module):
    def __init__(self, config: GlmTextConfig):
        super().__init__()
        dim, head_dim = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.scale = head_dim**-0.5
        self.rotary_dim = config.rotary_dim
        self.pairs = config.rotate_pairs
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)

    def turn(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """The first ``rotary_dim`` of each head turned, the rest passed through."""
        turned, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.pairs:  # the tables hold each frequency twice ([f, f]): one per pair
            half = self.rotary_dim // 2
            turned = rotate_pairs(turned, cos[..., :half], sin[..., :half])
        else:
            turned = apply_rotary(turned, cos, sin)
        return mx.concatenate([turned, rest], axis=-1)

    def __call__(self, x, rotary: tuple[mx.array, mx.array], mask, cache=None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        cos, sin = rotary
        queries, keys = self.turn(queries, cos, sin), self.turn(keys, cos, sin)
        queries = queries.transpose(0, 2, 1, 3)
        keys = keys.transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = cached_attention(queries, keys, values, cache, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Glm4vDecoderLayer(nn.Module):
    """GLM-4's block: norms before and after attention and the MLP."""

    def __init__(self, config: GlmTextConfig, index: int = 0):
        super().__init__()
        self.self_attn = GlmAttention(config)
        self.mlp = Glm4MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=eps)
        self.post_self_attn_layernorm = nn.RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=eps)
        self.post_mlp_layernorm = nn.RMSNorm(config.hidden_size, eps=eps)

    def __call__(self, x, rotary, mask, cache=None) -> mx.array:
        h = x + self.post_self_attn_layernorm(
            self.self_attn(self.input_layernorm(x), rotary, mask, cache))
        return h + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h)))


class Glm4vMoeDecoderLayer(nn.Module):
    """GLM-4.5's block: pre-norms only; experts after the first dense layers."""

    def __init__(self, config: GlmTextConfig, index: int = 0):
        super().__init__()
        self.self_attn = GlmAttention(config)
        if index >= config.first_k_dense_replace:
            self.mlp = MoE(config)
        else:
            self.mlp = Glm4MoeMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, rotary, mask, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), rotary, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class GlmDecoder(Qwen2MRopeModel):
    """``language_model.model``: the M-RoPE loop over GLM blocks, the tables over the
    turned part of each head in blocked sections."""

    def __init__(self, config: GlmTextConfig):
        MRopeDecoder.__init__(self, config, config.rotary_dim, interleaved=False)

    @staticmethod
    def layer_class(config: GlmTextConfig, index: int) -> nn.Module:
        """The block ``MRopeDecoder`` builds at ``index``."""
        if config.is_moe:
            return Glm4vMoeDecoderLayer(config, index)
        return Glm4vDecoderLayer(config, index)


class GlmLanguageModel(LanguageModel):
    """``language_model``: the decoder and its head."""

    decoder_class = GlmDecoder
