"""Qwen3-Omni's talker: the thinker's states in, codec codes out, one frame per step.

- The talker proper (``talker.model``): a Qwen3-MoE decoder whose experts have a gated
  shared expert beside them (mlx-lm's ``SwitchGLU`` for the routed ones), q/k norms and
  interleaved M-RoPE; its input is the sum of the codec embedding of the last frame's
  codes and a projection of the thinker's text (``text_projection``) or multimodal
  hidden states (``hidden_projection``). ``codec_head`` gives the frame's first code.
- The code predictor (``talker.code_predictor``): a small dense Qwen3 decoder run per
  frame from the talker's last hidden state and the first code's embedding, giving the
  frame's other ``num_code_groups - 1`` codes one after another, a head and an
  embedding per group.

Only the modules live here; ``mlxvlm.speech.talker`` runs them (prefill, the step,
sampling, stopping).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3 import ModelArgs as Qwen3Args
from mlx_lm.models.qwen3 import TransformerBlock as Qwen3Block
from mlx_lm.models.switch_layers import SwitchGLU

from mlxvlm.models.config_utils import rope_parameters
from mlxvlm.models.layers.mrope_decoder import (
    MLP,
    Attention,
    MultimodalRotaryEmbedding,
    TextConfig,
)


def _talker_text_config(text: dict) -> TextConfig:
    rope = rope_parameters(text, 1_000_000.0)
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"talker rope type {rope['rope_type']!r}")
    section = rope.get("mrope_section")
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return TextConfig(
        hidden_size=text["hidden_size"],
        num_hidden_layers=text["num_hidden_layers"],
        intermediate_size=text.get("intermediate_size", 2048),
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        vocab_size=text["vocab_size"],
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope["rope_theta"],
        # no section: the plain rope, as one section over every frequency
        mrope_section=tuple(section) if section else (head_dim // 2, 0, 0),
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        tie_word_embeddings=False,
        attention_bias=text.get("attention_bias", False),
        explicit_head_dim=head_dim,
        qk_norm=True,
        mrope_interleaved=bool(rope.get("interleaved", rope.get("mrope_interleaved", True))),
        num_experts=text.get("num_experts") or text.get("num_local_experts") or 0,
        num_experts_per_tok=text.get("num_experts_per_tok", 8),
        moe_intermediate_size=text.get("moe_intermediate_size", 384),
        norm_topk_prob=bool(text.get("norm_topk_prob", False)),
    )


@dataclass(frozen=True)
class TalkerConfig:
    text: TextConfig
    shared_expert_intermediate_size: int
    predictor: Qwen3Args
    num_code_groups: int
    thinker_hidden_size: int
    accept_hidden_layer: int
    codec_eos_token_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    speaker_id: dict
    projection_size: int  # the resize MLPs' inner width (the text config's intermediate size)

    @classmethod
    def from_hf(cls, talker: dict) -> "TalkerConfig":
        """transformers' ``talker_config`` in either layout."""
        text = dict(talker["text_config"])
        predictor = dict(talker["code_predictor_config"])
        p_rope = rope_parameters(predictor, 1_000_000.0)
        p_heads = predictor["num_attention_heads"]
        predictor_args = Qwen3Args(
            model_type="qwen3", hidden_size=predictor["hidden_size"],
            num_hidden_layers=predictor["num_hidden_layers"],
            intermediate_size=predictor["intermediate_size"], num_attention_heads=p_heads,
            rms_norm_eps=predictor.get("rms_norm_eps", 1e-6),
            vocab_size=predictor["vocab_size"],
            num_key_value_heads=predictor.get("num_key_value_heads") or p_heads,
            max_position_embeddings=predictor.get("max_position_embeddings", 32768),
            rope_theta=p_rope["rope_theta"],
            head_dim=predictor.get("head_dim") or predictor["hidden_size"] // p_heads,
            tie_word_embeddings=False,
        )
        if p_rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"code predictor rope type {p_rope['rope_type']!r}")
        text_config = _talker_text_config(text)
        return cls(
            text=text_config,
            shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0),
            predictor=predictor_args,
            num_code_groups=talker.get("num_code_groups", 32),
            thinker_hidden_size=talker["thinker_hidden_size"],
            accept_hidden_layer=talker.get("accept_hidden_layer", 18),
            codec_eos_token_id=talker["codec_eos_token_id"],
            codec_nothink_id=talker["codec_nothink_id"],
            codec_think_bos_id=talker["codec_think_bos_id"],
            codec_think_eos_id=talker["codec_think_eos_id"],
            codec_pad_id=talker["codec_pad_id"],
            codec_bos_id=talker["codec_bos_id"],
            speaker_id={str(k): int(v) for k, v in (talker.get("speaker_id") or {}).items()},
            projection_size=text_config.intermediate_size,
        )


class SharedExpertMoE(nn.Module):
    """Routed experts (softmax, top-k, optionally renormalized) plus a shared expert
    scaled by a sigmoid gate, as transformers' ``Qwen3OmniMoeTalkerTextSparseMoeBlock``."""

    def __init__(self, config: TextConfig, shared_size: int):
        super().__init__()
        dim = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(dim, config.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(dim, config.moe_intermediate_size, config.num_experts)
        self.shared_expert = MLP(dim, shared_size)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1, precise=True)
        k = self.top_k
        experts = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k])
        scores = mx.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        routed = (self.switch_mlp(x, experts) * scores[..., None].astype(x.dtype)).sum(axis=-2)
        shared = mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


class TalkerLayer(nn.Module):
    def __init__(self, config: TextConfig, shared_size: int):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = SharedExpertMoE(config, shared_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, rotary, mask, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), rotary, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class TalkerModel(nn.Module):
    """``talker.model``: the codec embedding, the MoE layers and the final norm."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        text = config.text
        self.codec_embedding = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = [TalkerLayer(text, config.shared_expert_intermediate_size)
                       for _ in range(text.num_hidden_layers)]
        self.norm = nn.RMSNorm(text.hidden_size, eps=text.rms_norm_eps)
        self.rotary = MultimodalRotaryEmbedding(text.head_dim, text.rope_theta,
                                                text.mrope_section, text.mrope_interleaved)

    def __call__(self, embeddings: mx.array, positions: mx.array, cache) -> mx.array:
        """``embeddings`` (1, L, hidden) at ``positions`` (3, L) -> the normed hidden states."""
        cos, sin = self.rotary(positions)
        rotary = cos.astype(embeddings.dtype), sin.astype(embeddings.dtype)
        mask = create_attention_mask(embeddings, cache[0])
        h = embeddings
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, rotary, mask, layer_cache)
        return self.norm(h)


class ResizeMLP(nn.Module):
    """The thinker's width -> the talker's: two linear layers around SiLU."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(in_dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, out_dim)

    def __call__(self, x):
        return self.linear_fc2(nn.silu(self.linear_fc1(x)))


class CodePredictorModel(nn.Module):
    def __init__(self, args: Qwen3Args, groups: int):
        super().__init__()
        self.layers = [Qwen3Block(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.codec_embedding = [nn.Embedding(args.vocab_size, args.hidden_size)
                                for _ in range(groups - 1)]

    def __call__(self, embeddings: mx.array, cache) -> mx.array:
        mask = create_attention_mask(embeddings, cache[0])
        h = embeddings
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, mask, layer_cache)
        return self.norm(h)


class CodePredictor(nn.Module):
    """``talker.code_predictor``: group ``g``'s code (g >= 1) from head ``g - 1``; the
    code fed back through embedding ``g - 1``."""

    def __init__(self, args: Qwen3Args, groups: int):
        super().__init__()
        self.args = args
        self.model = CodePredictorModel(args, groups)
        self.lm_head = [nn.Linear(args.hidden_size, args.vocab_size, bias=False)
                        for _ in range(groups - 1)]


class Talker(nn.Module):
    """``talker`` in checkpoints."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.config = config
        text = config.text
        self.model = TalkerModel(config)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.text_projection = ResizeMLP(config.thinker_hidden_size, config.projection_size,
                                         text.hidden_size)
        self.hidden_projection = ResizeMLP(config.thinker_hidden_size, config.projection_size,
                                           text.hidden_size)
        self.code_predictor = CodePredictor(config.predictor, config.num_code_groups)
