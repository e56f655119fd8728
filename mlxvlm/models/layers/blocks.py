"""Building blocks that several towers share under the same checkpoint names."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.pipeline import PipelineMixin

from mlxvlm.distributed.group import depend_on
from mlxvlm.models.layers.activations import activation


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``, the gated feed-forward of
    Qwen2.5-VL's and Pixtral's vision towers (with biases in Qwen's, without in Pixtral's)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LayerStack(nn.Module):
    """A module that only holds ``layers`` (``<name>.layers.N`` in checkpoints); its owner
    runs them."""

    def __init__(self, make_layer: Callable[[], nn.Module], count: int):
        super().__init__()
        self.layers = [make_layer() for _ in range(count)]


class TextDecoder(PipelineMixin, nn.Module):
    """Token embeddings, decoder blocks and the final norm (``language_model.model`` in
    checkpoints); a subclass builds its blocks and runs them.

    mlx-lm's ``PipelineMixin`` gives ``pipeline(group)`` (this rank's run of layers,
    ``pipeline_layers``); a subclass whose pass hands its states between the ranks says
    so with ``runs_pipelined``."""

    runs_pipelined = False

    def __init__(self, vocab_size: int, hidden_size: int, layers: list, norm: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = layers
        self.norm = norm

    def embed(self, inputs: mx.array) -> mx.array:
        return self.embed_tokens(inputs)

    # A pipelined pass, as mlx-lm's pipelined models run it: the last rank starts from
    # the embeddings, each rank receives from the next one up, runs its layers and
    # sends down; rank 0's states reach every rank (each computes the head).
    def receive(self, h: mx.array) -> mx.array:
        """The previous stage's states (``h`` itself on the first stage)."""
        if self.pipeline_rank < self.pipeline_size - 1:
            return mx.distributed.recv_like(h, self.pipeline_rank + 1)
        return h

    def hand_on(self, h: mx.array, cache: list) -> mx.array:
        """Send ``h`` to the next stage; the last stage's states, on every rank."""
        if self.pipeline_rank != 0:
            h = mx.distributed.send(h, self.pipeline_rank - 1)
            if cache[-1] is not None:  # the send runs whenever the cache is evaluated
                depend_on(cache[-1], h)
        if self.pipeline_size > 1:
            h = mx.distributed.all_gather(h)[: h.shape[0]]
        return h

    def start(self, inputs, cache, embeddings) -> tuple[mx.array, list]:
        """Where a forward pass starts: the hidden states (``embeddings``, else ``inputs``
        embedded) and the per-layer caches (one None per layer without a cache)."""
        h = self.embed(inputs) if embeddings is None else embeddings
        return h, cache if cache is not None else [None] * len(self.pipeline_layers)


class ScaledEmbeddingDecoder(TextDecoder):
    """Gemma's decoder shell: token embeddings times sqrt(hidden_size), the scale held in
    the compute dtype as transformers holds it (image features enter unscaled)."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list, norm: nn.Module):
        super().__init__(vocab_size, hidden_size, layers, norm)
        self.embed_scale = hidden_size**0.5

    def embed(self, inputs: mx.array) -> mx.array:
        h = self.embed_tokens(inputs)
        return h * mx.array(self.embed_scale, dtype=h.dtype)

