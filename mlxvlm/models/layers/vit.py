"""The pre-norm ViT encoder that CLIP and SigLIP share (transformers' ``CLIPEncoder``
and ``SiglipEncoder`` are the same maths): blocks of multi-head self-attention with
biased q/k/v/out projections, then a two-layer MLP, each behind a LayerNorm and a
residual connection. The towers differ only around it (embeddings, norms, masks).

Module names follow both towers' checkpoints: ``layers.N.self_attn.{q,k,v,out}_proj``,
``layers.N.layer_norm1``, ``layers.N.mlp.fc1``, ``layers.N.mlp.fc2``,
``layers.N.layer_norm2``. A config passed in needs ``hidden_size``, ``intermediate_size``,
``num_attention_heads``, ``num_hidden_layers``, ``hidden_act`` and ``layer_norm_eps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.cpu.ops import residual_plus, scaled_dot_product_attention
from mlxvlm.models import run_ahead
from mlxvlm.models.layers.activations import activation


@dataclass(frozen=True)
class VitConfig:
    """What the encoder reads from a CLIP/SigLIP tower's config (defaults: SigLIP's);
    the tower takes square ``image_size`` images cut into ``patch_size`` patches."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        dims = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.scale = (dims // self.num_heads) ** -0.5
        self.q_proj = nn.Linear(dims, dims)
        self.k_proj = nn.Linear(dims, dims)
        self.v_proj = nn.Linear(dims, dims)
        self.out_proj = nn.Linear(dims, dims)

    def __call__(self, x: mx.array, mask: mx.array | None = None,
                 residual: mx.array | None = None) -> mx.array:
        """``mask``: which keys each query may attend to (None: all of them); with
        ``residual``, returns ``residual`` plus the attention's output."""
        B, L, _ = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.out_proj(out) if residual is None else residual_plus(residual, self.out_proj, out)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.activation = activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        hidden = self.activation(self.fc1(x))
        return self.fc2(hidden) if residual is None else residual_plus(residual, self.fc2, hidden)


class EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Attention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array | None = None) -> mx.array:
        # The residual additions happen inside the output products where the layers can
        # take them (16-bit weights on the CPU: one pass less per addition).
        x = self.self_attn(self.layer_norm1(x), mask, residual=x)
        # Evaluated here too on the CPU (see run_ahead): what is allocated ahead is then
        # one half's operations, the MLP's 1024 x 3072 activations without the attention's
        # q/k/v beside them (SmolVLM's tower: 19 MB less at its peak).
        run_ahead.layer_done(x)
        return self.mlp(self.layer_norm2(x), residual=x)


class Encoder(nn.Module):
    """The blocks; the towers run them themselves, as they read hidden states between."""

    def __init__(self, config):
        super().__init__()
        self.layers = [EncoderLayer(config) for _ in range(config.num_hidden_layers)]
