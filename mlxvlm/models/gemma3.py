"""Gemma 3 (Gemma Team, 2025): a SigLIP vision tower whose 64x64 patch grid is average-pooled
to 16x16 soft tokens, RMS-normed and projected into the Gemma 3 text model, whose layers
alternate between sliding-window (local) and global attention.

Two things set the decoder apart from mlx-lm's ``gemma3_text``, whose blocks are reused:
the image tokens of one image attend to each other bidirectionally (as transformers does
with ``token_type_ids``), and image features enter unscaled while token embeddings are
multiplied by sqrt(hidden_size). The decoder loop and its masks are therefore written here.

Checkpoint names (as mlx-community publishes them): ``vision_tower.vision_model.*``,
``multi_modal_projector.*``, ``language_model.model.*`` and ``language_model.lm_head``
(always present: mlx-community's conversions store the head even though Gemma 3 ties it to
the embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import gemma3_text
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it, decoder_sizes
from mlxvlm.models.layers import siglip
from mlxvlm.models.layers.blocks import ScaledEmbeddingDecoder
from mlxvlm.models.weights import (
    LM_HEAD_NAMES,
    NESTED_TOWER_NAMES,
    PROJECTOR_NAMES,
    TEXT_MODEL_NAMES,
    has_transformers_names,
    map_hf_weights,
    tie_lm_head,
)

# Hugging Face name prefix -> ours. The Hub's original checkpoints
# (transformers 4.50) already use our names; transformers 4.52+ nest the modules under
# `model.`, and transformers 5 drops the SigLIP tower's `vision_model.` level.
HF_PREFIXES = (TEXT_MODEL_NAMES, PROJECTOR_NAMES, *NESTED_TOWER_NAMES, LM_HEAD_NAMES)
VISION_TOWER = "vision_tower.vision_model."
LM_HEAD = "language_model.lm_head.weight"
EMBED_TOKENS = "language_model.model.embed_tokens.weight"


# ----------------------------------------------------------------------------- config


def text_args(text: dict) -> gemma3_text.ModelArgs:
    """mlx-lm's Gemma 3 arguments from the text config as transformers reads it (see
    ``ModelArgs.from_hf``), checked against what mlx-lm's blocks implement."""
    n = text["num_hidden_layers"]
    global_rope = text["rope_parameters"]["full_attention"]
    local_rope = text["rope_parameters"]["sliding_attention"]
    layer_types = text["layer_types"]
    # mlx-lm's blocks place a global layer every `pattern` layers; check that is the case.
    pattern = n + 1
    if "full_attention" in layer_types:
        pattern = layer_types.index("full_attention") + 1
    expected = [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
    ]
    unsupported = {
        "layer_types that are not periodic": layer_types != expected,
        "use_bidirectional_attention": bool(text.get("use_bidirectional_attention")),
        "attention_bias": bool(text.get("attention_bias")),
        f"hidden_activation {text['hidden_activation']!r}": (
            text["hidden_activation"] != "gelu_pytorch_tanh"
        ),
        f"local rope type {local_rope.get('rope_type')!r}": (
            local_rope.get("rope_type") != "default"
        ),
    }
    for what, present in unsupported.items():
        if present:
            raise NotImplementedError(f"Gemma 3 with {what} is not supported")

    scaling = {k: v for k, v in global_rope.items() if k != "rope_theta"}
    return gemma3_text.ModelArgs(
        model_type="gemma3_text",
        **decoder_sizes(text),
        rope_theta=float(global_rope["rope_theta"]),
        rope_local_base_freq=float(local_rope["rope_theta"]),
        query_pre_attn_scalar=text["query_pre_attn_scalar"],
        sliding_window=text["sliding_window"],
        sliding_window_pattern=pattern,
        max_position_embeddings=text["max_position_embeddings"],
        rope_scaling=None if scaling.get("rope_type", "default") == "default" else scaling,
    )


@dataclass
class ModelArgs:
    text: gemma3_text.ModelArgs
    vision: siglip.SiglipVisionConfig
    mm_tokens_per_image: int
    image_token_id: int

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        """From either config layout. The Hub's config.json names only what differs from
        transformers' defaults (and the rope in its older keys), so it is read through
        transformers' own config classes."""
        config = as_transformers_reads_it(config)
        return cls(
            text=text_args(config["text_config"]),
            vision=siglip.SiglipVisionConfig.from_hf(config["vision_config"]),
            mm_tokens_per_image=config["mm_tokens_per_image"],
            image_token_id=config["image_token_index"],
        )


# ------------------------------------------------------------------------ projector


class MultiModalProjector(nn.Module):
    """Average-pools the patch grid to ``mm_tokens_per_image`` tokens, RMS-norms them and
    projects them to the text width."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        vision = args.vision
        self.patches_per_side = vision.patches_per_side
        tokens_per_side = int(args.mm_tokens_per_image**0.5)
        self.pool = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = mx.zeros((vision.hidden_size, args.text.hidden_size))
        # Gemma's RMSNorm, scaling by (1 + weight)
        self.mm_soft_emb_norm = gemma3_text.RMSNorm(vision.hidden_size, eps=vision.layer_norm_eps)

    def __call__(self, patches: mx.array) -> mx.array:
        B, _, D = patches.shape
        side, k = self.patches_per_side, self.pool
        grid = patches.reshape(B, side // k, k, side // k, k, D)
        pooled = grid.mean(axis=(2, 4)).reshape(B, -1, D)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


# -------------------------------------------------------------------------- decoder


@dataclass
class ImageBlocks:
    """Which image each prompt token belongs to (-1: text). The tokens of one image
    attend to each other in both directions."""

    ids: np.ndarray  # (prompt_length,) int

    @classmethod
    def from_input_ids(cls, ids: np.ndarray, image_token_id: int) -> "ImageBlocks":
        is_image = ids == image_token_id
        starts = is_image & ~np.concatenate([[False], is_image[:-1]])
        return cls(np.where(is_image, np.cumsum(starts) - 1, -1))

    @property
    def spans(self) -> list[tuple[int, int]]:
        """``[start, end)`` of each image's tokens."""
        is_image = np.concatenate([[False], self.ids >= 0, [False]]).astype(np.int8)
        edges = np.flatnonzero(np.diff(is_image))
        return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])]

    def splits_an_image(self, position: int) -> bool:
        """Whether a cut before prompt token ``position`` falls inside an image."""
        if not 0 < position < len(self.ids):
            return False
        return self.ids[position] >= 0 and self.ids[position - 1] == self.ids[position]

    @staticmethod
    def batch(states) -> None:
        """Decoding needs no image blocks: generated tokens are text."""
        return None

    def prefix(self, length: int) -> "ImageBlocks":
        """The blocks of a prompt sharing the first ``length`` tokens (prompt-cache reuse)."""
        if self.splits_an_image(length):
            raise NotImplementedError("a reused prompt prefix cannot end inside an image")
        return ImageBlocks(self.ids[:length])

    def chunk(self, offset: int, n: int) -> np.ndarray | None:
        """Block ids of the tokens at ``[offset, offset + n)``; None if they hold no image.
        Refuses a chunk boundary that falls inside an image."""
        ids = self.ids[offset : offset + n]
        if not (ids >= 0).any():
            return None
        for boundary in (offset, offset + n):
            if self.splits_an_image(boundary):
                raise ValueError(
                    f"a chunk boundary at prompt token {boundary} splits an image, whose "
                    "tokens attend to each other; chunk at the model's bidirectional_spans"
                )
        return ids


def attention_mask(h: mx.array, cache: Any, window: int | None, blocks: np.ndarray | None):
    """The causal (sliding-window) mask, opened up so that each image's tokens also see
    the later tokens of the same image. ``blocks``: block ids of the tokens in ``h``."""
    if blocks is None or len(blocks) == 1:
        return create_attention_mask(h, cache, window_size=window)
    causal = create_attention_mask(h, cache, window_size=window, return_array=True)
    n = len(blocks)
    block = mx.array(blocks)
    later = mx.arange(n)[None, :] > mx.arange(n)[:, None]
    same_image = (block[:, None] == block[None, :]) & (block[:, None] >= 0) & later
    # The chunk's own keys are the last n of the cache's keys.
    return mx.concatenate([causal[:, :-n], causal[:, -n:] | same_image], axis=1)


class TextModel(ScaledEmbeddingDecoder):
    """mlx-lm's Gemma 3 blocks under Gemma's scaled embeddings."""

    def __init__(self, args: gemma3_text.ModelArgs):
        super().__init__(
            args.vocab_size, args.hidden_size,
            [gemma3_text.TransformerBlock(args, i) for i in range(args.num_hidden_layers)],
            gemma3_text.RMSNorm(args.hidden_size, eps=args.rms_norm_eps),
        )
        self.args = args

    runs_pipelined = True

    def __call__(self, h: mx.array, cache: list[Any], blocks: np.ndarray | None) -> mx.array:
        # Pipelined, this rank's run of layers (and their caches) between receive and
        # hand_on; otherwise all of them.
        layers = self.pipeline_layers
        is_sliding = [layer.self_attn.is_sliding for layer in layers]
        masks = {}
        for sliding in set(is_sliding):
            c = cache[is_sliding.index(sliding)]
            masks[sliding] = attention_mask(
                h, c, self.args.sliding_window if sliding else None, blocks
            )
        h = self.receive(h)
        for layer, c, sliding in zip(layers, cache, is_sliding):
            h = layer(h, masks[sliding], c)
        return self.norm(self.hand_on(h, cache))


class LanguageModel(nn.Module):
    def __init__(self, args: gemma3_text.ModelArgs):
        super().__init__()
        self.model = TextModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


# ---------------------------------------------------------------------------- model


class Model(VisionLanguageModel):
    feature_names = ("pixel_values",)
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    processor_class = "Gemma3Processor"
    image_processor_class = "Gemma3ImageProcessorPil"

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = siglip.SiglipVisionModel(args.vision)
        self.multi_modal_projector = MultiModalProjector(args)
        self.language_model = LanguageModel(args.text)

    @classmethod
    def is_hf_checkpoint(cls, weight_names: Iterable[str]) -> bool:
        """transformers 4.52+ names start with ``model.`` or ``lm_head.``, transformers 5's
        saved SigLIP tower lacks ``vision_model.``. The Hub's original names are ours,
        except that they omit the tied LM head, which mlx-community's conversions store."""
        names = set(weight_names)
        return has_transformers_names(names, ours=VISION_TOWER) or LM_HEAD not in names

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        sanitized = map_hf_weights(
            weights, self.hf_to_mlx_name, towers={VISION_TOWER: siglip.convert_hf_weight}
        )
        return tie_lm_head(sanitized, LM_HEAD, EMBED_TOKENS)

    # -- the contract -----------------------------------------------------------------

    def make_cache(self) -> list[Any]:
        return [
            RotatingKVCache(max_size=self.args.text.sliding_window)
            if layer.self_attn.is_sliding
            else KVCache()
            for layer in self.layers
        ]

    def bidirectional_spans(self, state: ImageBlocks | None) -> list[tuple[int, int]]:
        return state.spans if state is not None else []

    def embed(self, input_ids: mx.array, pixel_values: Any = None) -> tuple[mx.array, ImageBlocks]:
        h, ids = merge.embed_image_tokens(self, input_ids, pixel_values)
        return h, ImageBlocks.from_input_ids(ids, self.args.image_token_id)

    def image_features(self, pixel_values: Any) -> mx.array:
        """(images, mm_tokens_per_image, hidden) from the processor's (images, C, H, W)."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        return siglip.projected_image_features(self, pixel_values, dtype)

    def __call__(
        self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False
    ) -> mx.array:
        h, cache = self.language_model.model.start(input_ids, cache, embeddings)
        offset = cache[0].offset if cache[0] is not None else 0
        blocks = state.chunk(offset, h.shape[1]) if state is not None else None
        h = self.language_model.model(h, cache, blocks)
        return self.language_model.lm_head(h[:, -1:] if last_only else h)


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
