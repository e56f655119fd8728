"""Llama 3.2 Vision (``mllama``): a tiled vision encoder whose features the Llama text
model reads through cross-attention layers placed between its self-attention layers.

The image is not spliced into the prompt: its ``<|image|>`` token is an ordinary
embedding, and the layers at ``cross_attention_layers`` attend from the text to the
image's projected states (all images' tiles, ``images x tiles x patches`` positions).
Which tiles a token reads comes from the processor's ``cross_attention_mask``: a token
reads the image(s) last named before it; a token before every image reads none, and then,
as transformers computes it, attends evenly to every position of the image states while
its layer's MLP output is dropped. A prompt without an image skips the cross-attention
layers. The keys and values of the image are projected once per sequence and kept in the
sequence's cache (``layers.cross_attention.CrossAttentionCache``), beside the
self-attention layers' KV caches; the per-request state is a
``layers.cross_attention.CrossAttentionState``.

Since every token's states depend on the prompt's images (through that even attention),
the model sets ``media_condition_every_token``: the prefix cache shares a prefix only
between prompts with the same images (the next turn of a chat about the same picture),
never across a new picture.

The self-attention layers are mlx-lm's ``llama`` blocks; the vision encoder is
``layers/mllama_vision.py``. Checkpoint names (mlx-community's): ``vision_tower.*``,
``multi_modal_projector.*``, ``language_model.model.*`` (an embedding of
``vocab_size + 8`` rows), ``language_model.lm_head.*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlxvlm.cpu.ops import scaled_dot_product_attention
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it
from mlxvlm.models.feature_cache import cached_rows
from mlxvlm.models.layers import mlx_lm_backbone
from mlxvlm.models.layers.blocks import TextDecoder
from mlxvlm.models.layers.cross_attention import (
    CrossAttentionCache,
    CrossAttentionState,
    new_source_id,
)
from mlxvlm.models.layers.mllama_vision import MllamaVisionConfig, MllamaVisionModel
from mlxvlm.models.weights import LM_HEAD_NAMES, PROJECTOR_NAMES, TEXT_MODEL_NAMES, map_hf_weights

VISION_TOWER = "vision_tower."
# (Hugging Face prefix, ours): transformers' module tree first (adapters are named after
# it), then the release's names, which transformers 5 also saves.
HF_PREFIXES = (
    TEXT_MODEL_NAMES,
    LM_HEAD_NAMES,
    ("model.vision_model.", VISION_TOWER),
    ("vision_model.", VISION_TOWER),
    PROJECTOR_NAMES,
)
# The embedding's rows past the head's vocabulary (the image token's among them).
EXTRA_EMBEDDINGS = 8


@dataclass(frozen=True)
class ModelArgs:
    text: llama.ModelArgs
    vision: MllamaVisionConfig
    image_token_id: int
    cross_attention_layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        config = as_transformers_reads_it(config)
        text = dict(config["text_config"])
        text["model_type"] = "llama"  # mlx-lm's blocks for the self-attention layers
        return cls(
            text=mlx_lm_backbone.model_args(text),
            vision=MllamaVisionConfig.from_hf(config["vision_config"]),
            image_token_id=config["image_token_index"],
            cross_attention_layers=tuple(config["text_config"]["cross_attention_layers"]),
        )


# ------------------------------------------------------------------------ the decoder


class CrossAttention(nn.Module):
    """Attention from the text to the image states; queries and keys RMS-normed per head."""

    def __init__(self, args: llama.ModelArgs):
        super().__init__()
        dims = args.hidden_size
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        head_dim = dims // self.n_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dims, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dims, self.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dims, self.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dims, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)

    def keys_and_values(self, source: mx.array) -> tuple[mx.array, mx.array]:
        B, S, _ = source.shape
        keys = self.k_norm(self.k_proj(source).reshape(B, S, self.n_kv_heads, -1))
        values = self.v_proj(source).reshape(B, S, self.n_kv_heads, -1)
        return keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, cache: CrossAttentionCache | None,
                 state: CrossAttentionState, mask: mx.array) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        if state.source is not None and (cache is None or not cache.holds(state.source_id)):
            keys, values = self.keys_and_values(state.source)
            if cache is not None:
                cache.fill(keys, values, state.source_id)
        else:
            keys, values = cache.keys, cache.values
        out = scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class CrossAttentionDecoderLayer(nn.Module):
    """Cross-attention and an MLP, each added through tanh of its own gate."""

    def __init__(self, args: llama.ModelArgs):
        super().__init__()
        self.cross_attn = CrossAttention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = llama.MLP(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.cross_attn_attn_gate = mx.zeros((1,))
        self.cross_attn_mlp_gate = mx.zeros((1,))

    def __call__(self, x: mx.array, cache: CrossAttentionCache | None,
                 state: CrossAttentionState | None,
                 inputs: tuple[mx.array, mx.array, mx.array] | None) -> mx.array:
        # No image: transformers skips these layers. Skipped here rather than by the
        # loop, so that a pipeline rank's edge layer still hands its states on.
        if state is None:
            return x
        mask, reads, present = inputs
        r = self.cross_attn(self.input_layernorm(x), cache, state, mask)
        h = x + mx.tanh(self.cross_attn_attn_gate) * r
        r = self.mlp(self.post_attention_layernorm(h)) * reads.astype(h.dtype)
        h = h + mx.tanh(self.cross_attn_mlp_gate) * r
        # A batch row without an image is not touched (its prompt skips these layers).
        return h if present is None else mx.where(present, h, x)


class TextModel(TextDecoder):
    def __init__(self, args: ModelArgs):
        text = args.text
        cross = set(args.cross_attention_layers)
        layers = [CrossAttentionDecoderLayer(text) if i in cross else llama.TransformerBlock(text)
                  for i in range(text.num_hidden_layers)]
        super().__init__(text.vocab_size + EXTRA_EMBEDDINGS, text.hidden_size, layers,
                         nn.RMSNorm(text.hidden_size, eps=text.rms_norm_eps))
        self.cross_attention_layers = cross
        self.first_self_attention = next(i for i in range(len(layers)) if i not in cross)

    def __call__(self, h: mx.array, cache: list[Any], state: CrossAttentionState | None) -> mx.array:
        self_cache = cache[self.first_self_attention]
        mask = create_attention_mask(h, self_cache)
        cross_inputs = None
        if state is not None:
            start = self_cache.offset if self_cache is not None else 0
            start = start if isinstance(start, int) else 0  # batched: decode rows only
            # The first cross-attention cache that holds keys: on a pipeline rank the
            # layers another rank runs never fill theirs.
            cross_cache = next((cache[i] for i in sorted(self.cross_attention_layers)
                                if cache[i] is not None and cache[i].holds(None)), None)
            fresh = state.source is not None and (
                cross_cache is None or not cross_cache.holds(state.source_id))
            if fresh or cross_cache is not None:
                key_length = state.source.shape[1] if fresh else cross_cache.keys.shape[2]
                cross_inputs = state.attention_inputs(start, h.shape[1], key_length)
            # else: a pipeline rank that runs no cross-attention layer reads no keys
        for index, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            if index in self.cross_attention_layers:
                h = layer(h, layer_cache, state, cross_inputs)
            else:
                h = layer(h, mask, layer_cache)
        return self.norm(h)


class LanguageModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.model = TextModel(args)
        self.lm_head = nn.Linear(args.text.hidden_size, args.text.vocab_size, bias=False)


# ---------------------------------------------------------------------------- the model


class Model(VisionLanguageModel):
    feature_names = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    mlx_prefixes = (VISION_TOWER,)
    processor_class = "MllamaProcessor"
    image_processor_class = "MllamaImageProcessorPil"
    # Tokens before an image attend to it too (evenly): a prompt's every token depends on
    # all of its images (see base.py).
    media_condition_every_token = True

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = MllamaVisionModel(args.vision)
        self.multi_modal_projector = nn.Linear(args.vision.vision_output_dim,
                                               args.text.hidden_size, bias=True)
        self.language_model = LanguageModel(args)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return map_hf_weights(weights, self.hf_to_mlx_name,
                              towers={VISION_TOWER: MllamaVisionModel.convert_hf_weight})

    @property
    def max_context(self) -> int | None:
        return self.args.text.max_position_embeddings

    def make_cache(self) -> list[Any]:
        cross = self.args.cross_attention_layers
        return [CrossAttentionCache() if i in cross else KVCache() for i in range(len(self.layers))]

    # -- images -------------------------------------------------------------------------

    def image_states(self, pixel_values: mx.array, aspect_ratio_ids: mx.array,
                     aspect_ratio_mask: mx.array) -> mx.array:
        """(images, tiles, C, H, W) -> (images, tiles, patches, text width): the tower's
        multi-layer features projected; each image encoded once (the feature cache)."""

        def encode(pixels, ids, tile_mask):
            features = self.vision_tower(pixels, ids, np.asarray(tile_mask))
            return self.multi_modal_projector(features)

        return cached_rows(self, "image", encode, pixel_values, aspect_ratio_ids, aspect_ratio_mask)

    def embed(self, input_ids: mx.array, pixel_values: Any = None, aspect_ratio_ids: Any = None,
              aspect_ratio_mask: Any = None, cross_attention_mask: Any = None):
        h = self.language_model.model.embed(input_ids)
        if pixel_values is None:
            return h, None
        if input_ids.shape[0] != 1:
            raise ValueError("Llama 3.2 Vision embeds one prompt at a time")
        pixel_values, aspect_ratio_ids, aspect_ratio_mask = (
            mx.array(x) if not isinstance(x, mx.array) else x
            for x in (pixel_values, aspect_ratio_ids, aspect_ratio_mask))
        states = self.image_states(pixel_values[0], aspect_ratio_ids[0], aspect_ratio_mask[0])
        images, tiles, patches, width = states.shape
        tile_mask = np.asarray(cross_attention_mask)[0].astype(bool)  # (L, images, tiles)
        ids = np.asarray(input_ids[0])
        return h, CrossAttentionState(
            block_mask=tile_mask.reshape(1, tile_mask.shape[0], images * tiles),
            blocks=[images * tiles],
            block_size=patches,
            source=states.reshape(1, images * tiles * patches, width).astype(h.dtype),
            source_id=new_source_id(),
            source_positions=tuple(int(i) for i in np.flatnonzero(ids == self.args.image_token_id)),
        )

    def __call__(self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False):
        decoder = self.language_model.model
        h, cache = decoder.start(input_ids, cache, embeddings)
        h = decoder(h, cache, state)
        return self.language_model.lm_head(h[:, -1:] if last_only else h)


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
