"""Qwen3.5's multi-token-prediction head (``mtp.*`` in the Hub's checkpoints), which
drafts the token after next for speculative decoding (``--mtp``).

The published design (Qwen3-Next / Qwen3.5, as vLLM runs it): at position ``i`` the head
takes the target's final hidden state there (after the decoder's last norm) and the
embedding of the token at ``i + 1``, normalizes each (``pre_fc_norm_hidden``,
``pre_fc_norm_embedding``), projects their concatenation -- embedding first -- back to
the model width (``fc``), runs one gated full-attention decoder layer of the target's kind
(its own KV cache, the target's positions), and a final norm; the target's shared output
head turns that into logits for the token at ``i + 2``. Chained, a step's output hidden
state stands in for the target's at the next position, with the token it drafted.

``mtp_num_hidden_layers`` layers: chained step ``k`` runs layer ``k mod n`` (one in every
released checkpoint).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlxvlm.errors import MlxvlmError
from mlxvlm.models.layers.hybrid_decoder import FULL, HybridDecoderLayer, HybridTextConfig

# Where a family keeps the head (``mtp.`` in the Hub's checkpoints): beside the decoder,
# so that quantization treats it as the text model's.
MTP = "language_model.mtp"


class MtpHead(nn.Module):
    """``language_model.mtp`` in our checkpoints (``mtp.`` in the Hub's)."""

    def __init__(self, config: HybridTextConfig):
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(width, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(width, eps=eps)
        self.fc = nn.Linear(2 * width, width, bias=False)
        count = config.mtp_num_hidden_layers
        # Every head layer is full attention, with the decoder's MLP (MoE in Qwen3.5-MoE).
        full = replace(config, layer_types=(FULL,) * count)
        self.layers = [HybridDecoderLayer(full, i) for i in range(count)]
        self.norm = nn.RMSNorm(width, eps=eps)

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.layers]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list[Any],
                 rotary: tuple[mx.array, mx.array], step: int = 0) -> mx.array:
        """The head's normed hidden states for slots whose next token's ``embeddings``
        and target (or previous step's) ``hidden`` states are given, each (B, n, width),
        at the positions ``rotary`` rotates by; ``step``: which chained step this is."""
        x = mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                            self.pre_fc_norm_hidden(hidden)], axis=-1)
        h = self.fc(x)
        index = step % len(self.layers)
        layer_cache = cache[index]
        masks = (None, create_attention_mask(h, layer_cache))
        h = self.layers[index](h, rotary, masks, layer_cache)
        return self.norm(h)


class MtpTarget:
    """A language model with an ``mtp`` head, as the MTP drafter uses it: the target's
    final hidden states and logits apart, token embeddings, and the head's steps at the
    target's positions."""

    def __init__(self, language_model: nn.Module):
        self.language_model = language_model
        self.head: MtpHead = language_model.mtp

    def hidden_states(self, input_ids, cache, embeddings=None, state=None) -> mx.array:
        """The decoder's normed last hidden states at every fed position."""
        return self.language_model.model(input_ids, cache, embeddings, state)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.language_model.logits(hidden)

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.language_model.model.embed_tokens(ids)

    def make_cache(self) -> list[Any]:
        return self.head.make_cache()

    def step(self, embeddings: mx.array, hidden: mx.array, cache: list[Any], state: Any,
             position: int, step: int = 0) -> mx.array:
        """The head over slots from target position ``position`` (rotated as the target
        rotates its tokens there: ``state`` is the request's M-RoPE state)."""
        rotary = self.language_model.model.rotary.for_tokens(
            state, position, embeddings.shape[1], embeddings.dtype)
        return self.head(embeddings, hidden, cache, rotary, step)


def mtp_target(language_model: nn.Module) -> MtpTarget:
    """``multi_token_predictor`` of a family whose text model may carry the head."""
    if "mtp" not in language_model:
        raise MlxvlmError(
            "--mtp given but the checkpoint has no MTP head (no mtp.* weights: an mlx-lm "
            "conversion drops them); use the Hub's checkpoint or convert it with "
            "python -m mlxvlm.convert, which keeps them")
    return MtpTarget(language_model)
