"""Granite-Docling (IBM, ``granite_docling``: ibm-granite/granite-for-docling-500m): pages
to document markup.

The processor cuts a page into square tiles of the tower's size plus a thumbnail, as
Idefics3's does (GotOcr2's grid choice, ``<row_r_col_c>`` markers around each tile's run
of ``<image>`` tokens). A SigLIP tower embeds each tile; its connector pixel-shuffles
every s x s block of patches (Idefics3's fold) into one token, projects it, adds a fixed
2D sine-cosine position table and goes through LayerNorm-GELU-linear-LayerNorm. The
tower's intermediate layers (``deepstack_visual_indexes``) are folded and projected too
(DeepStack): their rows are added to the image tokens' hidden states after the decoder's
first layers, as Qwen3-VL adds its own. The decoder is Granite's (mlx-lm's ``granite``
blocks: embedding, residual, attention and logit multipliers).

Two connector paths share the LayerNorms and output projection: coarse (``scale_factor``)
and fine (half of it: four times the tokens per tile). The processor picks one for all its
pages -- ``fine_route`` in the checkpoint's preprocessor_config.json, returned as
``tile_fine_mask`` -- and the prompt carries the matching number of ``<image>`` tokens;
the model follows the mask. (transformers' density router, which predicts a page's path
before the processor is run again with it, is not run: its weights are left out.)

Checkpoint names: ``vision_model.*`` (the tower, its ``connector.*`` inside),
``language_model.*`` (embed_tokens, layers, norm; lm_head when untied).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import granite
from mlx_lm.models.base import create_attention_mask

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it, rope_parameters
from mlxvlm.models.feature_cache import cached_features, join_rows
from mlxvlm.models.layers import mlx_lm_backbone, siglip, vit
from mlxvlm.models.layers.mrope_decoder import DeepstackFeatures
from mlxvlm.models.layers.pixel_shuffle import fold_blocks
from mlxvlm.models.processor_utils import pil_processor
from mlxvlm.models.weights import LM_HEAD_NAMES, map_hf_weights, tie_lm_head

HF_PREFIXES = (
    ("model.vision_model.", "vision_model."),
    ("model.text_model.", "language_model."),
    LM_HEAD_NAMES,
)
VISION_MODEL = "vision_model."
LM_HEAD = "language_model.lm_head.weight"
EMBED_TOKENS = "language_model.embed_tokens.weight"
# The density router (see the module's docstring) and the extra prediction head some
# checkpoints carry for serving engines' drafting.
UNUSED = ("model.density_router.", "density_router.", "mtp.")


@dataclass(frozen=True)
class VisionArgs:
    tower: siglip.SiglipVisionConfig
    out_hidden_size: int
    scale_factor: int
    deepstack_visual_indexes: tuple[int, ...]
    use_fine_route: bool


@dataclass(frozen=True)
class ModelArgs:
    text: granite.ModelArgs
    vision: VisionArgs
    image_token_id: int

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        """From the checkpoint's config read through transformers' GraniteDoclingConfig
        (which fills what a saved config leaves out with its defaults)."""
        config = as_transformers_reads_it(config)
        text = dict(config["text_config"], model_type="granite")
        text["rope_parameters"] = rope_parameters(text, 10_000.0)
        text["tie_word_embeddings"] = bool(config["tie_word_embeddings"])
        vision = config["vision_config"]
        return cls(
            text=mlx_lm_backbone.model_args(text),
            vision=VisionArgs(
                tower=siglip.SiglipVisionConfig.from_hf(vision),
                out_hidden_size=vision["out_hidden_size"],
                scale_factor=vision["scale_factor"],
                deepstack_visual_indexes=tuple(vision["deepstack_visual_indexes"]),
                use_fine_route=bool(vision["use_fine_route"]),
            ),
            image_token_id=config["image_token_id"],
        )


# -- the tower and its connector -------------------------------------------------------


def sincos_table(embed_dim: int, side: int) -> np.ndarray:
    """The fixed (side * side, embed_dim) position table of a tile's tokens, row by row:
    per token [sin(col w) | cos(col w) | sin(row w) | cos(row w)] over the frequencies
    w = 10000^(-i / (embed_dim / 4)), computed in float64 as transformers does."""
    quarter = embed_dim // 4
    omega = 1.0 / 10_000.0 ** (np.arange(quarter, dtype=np.float64) / quarter)
    rows, columns = np.meshgrid(np.arange(side, dtype=np.float64),
                                np.arange(side, dtype=np.float64), indexing="ij")
    by_row = np.outer(rows.reshape(-1), omega)
    by_column = np.outer(columns.reshape(-1), omega)
    table = [np.sin(by_column), np.cos(by_column), np.sin(by_row), np.cos(by_row)]
    return np.concatenate(table, axis=1).astype(np.float32)


class DeepStackMerger(nn.Module):
    def __init__(self, width: int, out: int):
        super().__init__()
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, out)
        self.linear_2 = nn.Linear(out, out)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(nn.gelu(self.linear_1(self.layer_norm(x))))


class ConnectorPath(nn.Module):
    """One pixel-shuffle factor: the fold, its projection and position table, and its
    DeepStack mergers."""

    def __init__(self, args: VisionArgs, scale_factor: int):
        super().__init__()
        self.scale_factor = scale_factor
        width = args.tower.hidden_size * scale_factor**2
        self.projection = nn.Linear(width, args.out_hidden_size, bias=False)
        self.deepstack_mergers = [DeepStackMerger(width, args.out_hidden_size)
                                  for _ in args.deepstack_visual_indexes]
        side = args.tower.image_size // args.tower.patch_size // scale_factor
        self._positions = mx.array(sincos_table(args.out_hidden_size, side))  # not a weight

    def fold(self, patches: mx.array) -> mx.array:
        side = int(patches.shape[1] ** 0.5)
        return fold_blocks(patches, side, side, self.scale_factor)

    def __call__(self, patches: mx.array, taps: Sequence[mx.array]):
        tokens = self.projection(self.fold(patches))
        tokens = tokens + self._positions.astype(tokens.dtype)
        return tokens, [merger(self.fold(tap)) for merger, tap in zip(self.deepstack_mergers, taps)]


class Connector(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.ln_in = nn.LayerNorm(args.tower.hidden_size)
        self.coarse = ConnectorPath(args, args.scale_factor)
        if args.use_fine_route:
            self.fine = ConnectorPath(args, args.scale_factor // 2)
        self.ln_mid = nn.LayerNorm(args.out_hidden_size)
        self.mlp_fc2 = nn.Linear(args.out_hidden_size, args.out_hidden_size, bias=False)
        self.ln_out = nn.LayerNorm(args.out_hidden_size)

    def __call__(self, patches: mx.array, taps: Sequence[mx.array], fine: bool):
        """(tiles, patches, D) -> (tiles, tokens, text width) and the DeepStack rows of
        the same shape, one per tap."""
        path = self.fine if fine else self.coarse
        tokens, deepstack = path(self.ln_in(patches), taps)
        return self.ln_out(self.mlp_fc2(nn.gelu(self.ln_mid(tokens)))), deepstack


class VisionModel(nn.Module):
    """SigLIP's embeddings and blocks over whole tiles (no padding patches), the taps
    read between them, and the connector."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.taps = frozenset(args.deepstack_visual_indexes)
        self.embeddings = siglip.VisionEmbeddings(args.tower)
        self.encoder = vit.Encoder(args.tower)
        self.post_layernorm = nn.LayerNorm(args.tower.hidden_size, eps=args.tower.layer_norm_eps)
        self.connector = Connector(args)

    def __call__(self, tiles: mx.array, fine: bool):
        """(tiles, H, W, C) -> image tokens and DeepStack rows, each (tiles, tokens, D)."""
        h = self.embeddings(tiles, None)
        taps = []
        for index, layer in enumerate(self.encoder.layers):
            h = layer(h)
            if index in self.taps:
                taps.append(h)
        return self.connector(self.post_layernorm(h), taps, fine)


# -- the decoder ------------------------------------------------------------------------


class LanguageModel(nn.Module):
    """Granite's decoder (mlx-lm's blocks) taking input embeddings, with DeepStack rows
    added after its first layers, and its output head."""

    def __init__(self, args: granite.ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [granite.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs, cache=None, embeddings=None, deepstack=None, last_only=False):
        h = self.embed_tokens(inputs) if embeddings is None else embeddings
        # transformers scales the merged embeddings, image tokens included
        h = h * self.args.embedding_multiplier
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for index, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            h = layer(h, mask, cache=layer_cache)
            if deepstack is not None and index < len(deepstack[1]):
                where, rows = deepstack
                h = h.at[where].add(rows[index].astype(h.dtype))
        h = self.norm(h)
        if last_only:
            h = h[:, -1:]
        head = self.lm_head if "lm_head" in self else self.embed_tokens.as_linear
        return head(h) / self.args.logits_scaling


@dataclass
class DeepstackState:
    """A prompt's DeepStack rows by position. They enter during its own prefill only:
    decoding and a prompt reusing its prefix (whose cache holds them) need no state."""

    deepstack: DeepstackFeatures

    @staticmethod
    def batch(states) -> None:
        return None

    def prefix(self, length: int) -> None:
        return None

    def stored(self) -> None:
        return None


class Model(VisionLanguageModel):
    feature_names = ("pixel_values", "pixel_attention_mask", "tile_fine_mask")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    unused_weight_prefixes = UNUSED

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_model = VisionModel(args.vision)
        self.language_model = LanguageModel(args.text)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        sanitized = map_hf_weights(
            weights, self.hf_to_mlx_name, towers={VISION_MODEL: siglip.convert_hf_weight}
        )
        if self.args.text.tie_word_embeddings:  # the head reads the embedding
            sanitized.pop(LM_HEAD, None)
            return sanitized
        return tie_lm_head(sanitized, LM_HEAD, EMBED_TOKENS)

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        return pil_processor(model_path, "GraniteDoclingProcessor", "GraniteDoclingImageProcessorPil")

    # -- the contract -----------------------------------------------------------------

    def embed(self, input_ids: mx.array, pixel_values: Any = None, pixel_attention_mask: Any = None,
              tile_fine_mask: Any = None) -> tuple[mx.array, DeepstackState | None]:
        features = deepstack = None
        if pixel_values is not None:
            fine = tile_fine_mask is not None and bool(np.asarray(tile_fine_mask).any())
            if fine and not self.args.vision.use_fine_route:
                raise ValueError("the processor asks for the fine connector path "
                                 "(fine_route), which this checkpoint does not have "
                                 "(use_fine_route is false)")
            features, deepstack = self.image_features(pixel_values, pixel_attention_mask, fine)
        h, ids = merge.embed_with_features(
            self.language_model.embed_tokens, input_ids, self.args.image_token_id, features,
            "<image> tokens",
        )
        if not deepstack:
            return h, None
        positions = merge.placeholder_positions(ids, self.args.image_token_id)
        mx.eval(deepstack)  # the loop evaluates embeddings and arrays, not the state
        return h, DeepstackState(DeepstackFeatures(np.asarray(positions), deepstack))

    def image_features(self, pixel_values: Any, pixel_attention_mask: Any = None, fine: bool = False):
        """The image tokens of every real tile in order, (tokens, text width), and one
        array of DeepStack rows of the same shape per tap. ``pixel_values``: the
        processor's (samples, tiles, C, H, W), padding tiles false in its
        ``pixel_attention_mask`` (samples, tiles)."""
        pixels = np.asarray(pixel_values, dtype=np.float32)
        pixels = pixels.reshape(-1, *pixels.shape[-3:])
        if pixel_attention_mask is not None:
            pixels = pixels[np.asarray(pixel_attention_mask, dtype=bool).reshape(-1)]
        dtype = self.vision_model.post_layernorm.weight.dtype  # never quantized

        def encode(indices: list[int]):
            tiles = mx.array(pixels[indices].transpose(0, 2, 3, 1)).astype(dtype)
            tokens, deepstack = self.vision_model(tiles, fine)
            return [tuple(column[i] for column in (tokens, *deepstack)) for i in range(len(indices))]

        kind = "fine image tile" if fine else "image tile"
        outputs = cached_features(self, kind, [(tile,) for tile in pixels], encode)
        columns = [join_rows(list(column)) for column in zip(*outputs)]
        return columns[0], columns[1:]

    def __call__(self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False):
        deepstack = None
        if state is not None:
            offset = cache[0].offset if cache is not None and cache[0] is not None else 0
            deepstack = state.deepstack.window(offset, (input_ids if embeddings is None else embeddings).shape[1])
        return self.language_model(input_ids, cache, embeddings, deepstack, last_only)


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
