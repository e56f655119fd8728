"""Qwen2.5-Omni's talker: the thinker's states in, one codec code per step out.

A Qwen2 decoder (q/k/v biases, M-RoPE over sections of each head, the thinker's layer
blocks from ``layers/mrope_decoder.py``) whose input is ``thinker_to_talker_proj`` of a
row in the thinker's width: the thinker's last hidden state plus its input embedding of
a token (or the embedding alone), plus the codec embedding (``model.embed_tokens``, in
the thinker's width too) of the code spoken last. ``codec_head`` gives the next code.

Only the modules live here; ``mlxvlm.speech.qwen2_5_omni_talker`` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from mlxvlm.models.config_utils import rope_parameters
from mlxvlm.models.layers.mrope_decoder import DecoderLayer, MultimodalRotaryEmbedding, TextConfig


@dataclass(frozen=True)
class TalkerConfig:
    text: TextConfig
    embedding_size: int  # the thinker's width: the codec embedding's and the inputs'
    codec_bos_id: int
    codec_eos_id: int
    codec_pad_id: int
    codec_mask_id: int
    text_eos_id: int  # the thinker's tokens whose embeddings end the text it hears
    text_pad_id: int

    @classmethod
    def from_hf(cls, talker: dict) -> "TalkerConfig":
        """transformers' ``talker_config`` (the Hub's ``rope_scaling`` + ``rope_theta``
        or transformers 5's ``rope_parameters``; transformers' defaults where a key is
        missing)."""
        rope = rope_parameters(talker, 1_000_000.0)
        if rope.get("rope_type", "default") not in ("default", "mrope"):
            raise NotImplementedError(f"talker rope type {rope['rope_type']!r}")
        if talker.get("use_sliding_window"):
            raise NotImplementedError("a talker with use_sliding_window=true")
        heads = talker.get("num_attention_heads", 28)
        hidden = talker.get("hidden_size", 3584)
        text = TextConfig(
            hidden_size=hidden,
            num_hidden_layers=talker.get("num_hidden_layers", 28),
            intermediate_size=talker.get("intermediate_size", 18944),
            num_attention_heads=heads,
            num_key_value_heads=talker.get("num_key_value_heads") or heads,
            vocab_size=talker.get("vocab_size", 8448),
            rms_norm_eps=talker.get("rms_norm_eps", 1e-6),
            rope_theta=rope["rope_theta"],
            mrope_section=tuple(rope["mrope_section"]),
            max_position_embeddings=talker.get("max_position_embeddings", 32768),
            tie_word_embeddings=False,
            attention_bias=True,
            explicit_head_dim=talker.get("head_dim") or hidden // heads,
        )
        return cls(
            text=text,
            embedding_size=talker.get("embedding_size", 3584),
            codec_bos_id=talker.get("tts_codec_start_token_id", 8293),
            codec_eos_id=talker.get("tts_codec_end_token_id", 8294),
            codec_pad_id=talker.get("tts_codec_pad_token_id", 8292),
            codec_mask_id=talker.get("tts_codec_mask_token_id", 8296),
            text_eos_id=talker.get("tts_text_end_token_id", 151861),
            text_pad_id=talker.get("tts_text_pad_token_id", 151859),
        )


class TalkerModel(nn.Module):
    """``talker.model``: the codec embedding, the Qwen2 layers and the final norm."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        text = config.text
        self.embed_tokens = nn.Embedding(text.vocab_size, config.embedding_size)
        self.layers = [DecoderLayer(text, i) for i in range(text.num_hidden_layers)]
        self.norm = nn.RMSNorm(text.hidden_size, eps=text.rms_norm_eps)
        self.rotary = MultimodalRotaryEmbedding(text.head_dim, text.rope_theta,
                                                text.mrope_section)

    def __call__(self, inputs: mx.array, positions: mx.array, cache) -> mx.array:
        """``inputs`` (1, L, hidden), projected, at ``positions`` (3, L) -> the normed
        hidden states."""
        cos, sin = self.rotary(positions)
        rotary = cos.astype(inputs.dtype), sin.astype(inputs.dtype)
        mask = create_attention_mask(inputs, cache[0])
        h = inputs
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, rotary, mask, layer_cache)
        return self.norm(h)


class Talker(nn.Module):
    """``talker`` in checkpoints."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.config = config
        self.thinker_to_talker_proj = nn.Linear(config.embedding_size, config.text.hidden_size)
        self.model = TalkerModel(config)
        self.codec_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)

    def __call__(self, rows: mx.array, positions: mx.array, cache) -> mx.array:
        """Rows in the thinker's width (1, L, embedding_size) -> the codec logits of the
        last one (1, vocab), float32."""
        hidden = self.model(self.thinker_to_talker_proj(rows), positions, cache)
        return self.codec_head(hidden[:, -1]).astype(mx.float32)
