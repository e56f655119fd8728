"""LFM2-VL (Liquid AI, 2025): a SigLIP 2 NaFlex vision encoder sees each image (or each
``tile_size`` tile of a large one, plus a thumbnail) at its own aspect ratio; every
``downsample_factor`` x ``downsample_factor`` block of patch features is folded into one
token (pixel unshuffle), and a LayerNorm + two-layer GELU MLP projects it to the text
width. The tokens replace the ``<image>`` placeholders ahead of LFM2, a hybrid decoder of
short gated convolutions and grouped-query attention (mlx-lm's ``lfm2``, through its input
embeddings; its convolution layers keep their last inputs in an ``ArraysCache``).

Checkpoint names (as mlx-community publishes them): ``vision_tower.*`` (embeddings,
encoder, post_layernorm), ``multi_modal_projector.*`` and ``language_model.model.*``;
the LM head is the tied embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it, token_id
from mlxvlm.models.feature_cache import cached_features
from mlxvlm.models.layers import mlx_lm_backbone, siglip2
from mlxvlm.models.layers.activations import activation
# transformers' pixel_unshuffle (module-level, so that a test can swap it)
from mlxvlm.models.layers.pixel_shuffle import fold_blocks as unshuffle
from mlxvlm.models.processor_utils import tokenizer_and_chat_template
from mlxvlm.models.weights import PROJECTOR_NAMES, TEXT_MODEL_NAMES, map_hf_weights

# Hugging Face name prefix -> ours. transformers 5's module tree first; the Hub's
# checkpoints nest the tower's modules one level down (``vision_model.``).
HF_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    PROJECTOR_NAMES,
    TEXT_MODEL_NAMES,
)
TOWER = "vision_tower."
LM_HEAD = "lm_head.weight"


def lfm2_text_args(text: dict):
    """mlx-lm's lfm2 ``ModelArgs`` for a transformers ``Lfm2Config`` dict. transformers
    sizes the MLP from ``hidden_size`` and ``intermediate_size`` (the Hub's
    ``block_ff_dim``), and rounds it to ``block_multiple_of`` only when a
    ``block_ffn_dim_multiplier`` is set; mlx-lm always rounds, so a multiple of one stands
    for no rounding."""
    rope = text["rope_parameters"]
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(
            f"LFM2 with {rope['rope_type']!r} rope scaling is not supported (mlx-lm's lfm2 "
            "applies none)"
        )
    if not text["tie_word_embeddings"]:
        raise NotImplementedError("LFM2 with an untied LM head is not supported (mlx-lm's "
                                  "lfm2 reads its logits off the embedding)")
    text = {**text, "block_dim": text["hidden_size"], "block_ff_dim": text["intermediate_size"]}
    if text["block_ffn_dim_multiplier"] is None:
        text["block_multiple_of"] = 1
    return mlx_lm_backbone.model_args(text)


@dataclass(frozen=True)
class ModelArgs:
    text: Any  # mlx_lm.models.lfm2.ModelArgs
    vision: siglip2.Siglip2VisionConfig
    image_token_id: int
    downsample_factor: int
    projector_hidden_size: int
    projector_hidden_act: str
    projector_bias: bool
    projector_use_layernorm: bool

    @property
    def max_context(self) -> int | None:
        return self.text.max_position_embeddings

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        """From either config layout, read through transformers' own config classes (the
        Hub's text_config says ``block_ff_dim`` for ``intermediate_size``, and may leave
        out rope_parameters and layer_types)."""
        # LiquidAI's first configs say "lfm2-vl" and image_token_index
        image_token_id = token_id(config, "image_token")
        config = as_transformers_reads_it({**config, "model_type": "lfm2_vl"})
        text = dict(config["text_config"])
        text["tie_word_embeddings"] = bool(config["tie_word_embeddings"])
        activation(config["projector_hidden_act"])  # refuses an unsupported one now
        return cls(
            text=lfm2_text_args(text),
            vision=siglip2.Siglip2VisionConfig.from_hf(config["vision_config"]),
            image_token_id=config["image_token_id"] if image_token_id is None else image_token_id,
            downsample_factor=config["downsample_factor"],
            projector_hidden_size=config["projector_hidden_size"],
            projector_hidden_act=config["projector_hidden_act"],
            projector_bias=config["projector_bias"],
            projector_use_layernorm=config["projector_use_layernorm"],
        )


class MultiModalProjector(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.vision.hidden_size * args.downsample_factor**2
        if args.projector_use_layernorm:
            self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, args.projector_hidden_size, bias=args.projector_bias)
        self.activation = activation(args.projector_hidden_act)
        self.linear_2 = nn.Linear(args.projector_hidden_size, args.text.hidden_size,
                                  bias=args.projector_bias)

    def __call__(self, x: mx.array) -> mx.array:
        if "layer_norm" in self:
            x = self.layer_norm(x)
        return self.linear_2(self.activation(self.linear_1(x)))


class Model(mlx_lm_backbone.MlxLmDecoder, VisionLanguageModel):
    feature_names = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    mlx_prefixes = ("language_model.model.",)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = siglip2.Siglip2VisionModel(args.vision)
        self.multi_modal_projector = MultiModalProjector(args)
        self.language_model = mlx_lm_backbone.text_model(args.text)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        sanitized = map_hf_weights(
            weights, self.hf_to_mlx_name, towers={TOWER: siglip2.convert_hf_weight},
            drop={LM_HEAD},  # tied to the embedding
        )
        for name, value in sanitized.items():
            if name.endswith(".conv.conv.weight") and value.shape[1] == 1:
                # PyTorch's depthwise Conv1d (channels, 1, kernel) -> MLX's (channels, kernel, 1)
                sanitized[name] = value.transpose(0, 2, 1)
        return sanitized

    @classmethod
    def load_processor(cls, model_path, config: dict):
        """transformers' Lfm2VlProcessor over mlxvlm's numpy image processor (transformers
        ships LFM2-VL's for torchvision only)."""
        from transformers import Lfm2VlProcessor

        from mlxvlm.models.lfm2_vl_images import Lfm2VlImageProcessorPil

        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        image_processor = Lfm2VlImageProcessorPil.from_pretrained(model_path)
        return Lfm2VlProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               chat_template=chat_template)

    # -- the contract -----------------------------------------------------------------

    def embed(self, input_ids: mx.array, pixel_values: Any = None,
              pixel_attention_mask: Any = None, spatial_shapes: Any = None) -> tuple[mx.array, None]:
        features = None
        if pixel_values is not None:
            features = self.image_features(pixel_values, spatial_shapes)
        h, _ = merge.embed_with_features(
            self.language_model.model.embed_tokens, input_ids, self.args.image_token_id,
            features, "<image> tokens",
        )
        return h, None

    def image_features(self, pixel_values: Any, spatial_shapes: Any) -> mx.array:
        """(tokens, text width) for the processor's (views, patches, p * p * C) padded
        patches and (views, 2) patch grids, view after view (tiles, then thumbnail)."""
        pixels = np.asarray(pixel_values, dtype=np.float32)
        shapes = np.asarray(spatial_shapes).reshape(-1, 2).tolist()
        items = [(pixels[i, : r * c], np.array([r, c])) for i, (r, c) in enumerate(shapes)]
        dtype = self.vision_tower.post_layernorm.weight.dtype  # never quantized
        factor = self.args.downsample_factor

        def encode(indices: list[int]) -> list[tuple[mx.array]]:  # view by view
            out = []
            for i in indices:
                patches, (rows, columns) = items[i][0], shapes[i]
                h = self.vision_tower(mx.array(patches[None]).astype(dtype), rows, columns)
                out.append((self.multi_modal_projector(unshuffle(h[0], rows, columns, factor)),))
            return out

        views = cached_features(self, "image view", items, encode)
        return mx.concatenate([v[0] for v in views])


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
