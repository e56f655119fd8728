"""InternVL (Chen et al., 2024; InternVL3.5: Wang et al., 2025) in transformers' native
layout (``model_type: internvl``, the Hub's ``OpenGVLab/InternVL3_5-*-HF`` checkpoints).

The processor (transformers' ``GotOcr2`` image processor) cuts a picture into a grid of
square tiles whose aspect ratio is closest to the picture's (``min_patches`` to
``max_patches`` tiles) and adds the whole picture as a thumbnail tile; a video's frames
are tiles too, one each. InternViT (``layers/intern_vit.py``) embeds every tile; its
patch features, the class token dropped, are folded by a pixel shuffle (every
``1 / downsample_ratio`` square of patches into one token, transformers' channel order)
and projected by a LayerNorm + two-layer MLP to the text width. The tokens replace the
``<IMG_CONTEXT>`` placeholders (``image_seq_length`` per tile, between ``<img>`` and
``</img>``) ahead of a stock text model: Qwen3 for InternVL3.5 (Qwen3-MoE for its
30B-A3B and 241B-A28B sizes), Qwen2 or Llama for InternVL3 (mlx-lm's, through its input
embeddings).

Checkpoint names (mlx-community's, transformers' module names without the ``model.``
level): ``vision_tower.*``, ``multi_modal_projector.{layer_norm,linear_1,linear_2}``,
``language_model.model.*`` and ``language_model.lm_head`` unless tied; a Qwen3-MoE layer's
experts stacked as mlx-lm's ``mlp.switch_mlp.{gate,up,down}_proj`` (experts, out, in).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it, rope_parameters
from mlxvlm.models.feature_cache import cached_rows
from mlxvlm.models.internvl_video import InternVLVideoProcessor
from mlxvlm.models.layers import intern_vit, mlx_lm_backbone
from mlxvlm.models.layers.activations import activation
# transformers' InternVLModel.pixel_shuffle (module-level, so that a test can swap it)
from mlxvlm.models.layers.pixel_shuffle import fold_blocks as pixel_shuffle
from mlxvlm.models.processor_utils import image_only, tokenizer_and_chat_template
from mlxvlm.models.qwen3_vl_moe import split_experts, stack_expert_modules
from mlxvlm.models.weights import (
    LM_HEAD_NAMES,
    PROJECTOR_NAMES,
    TEXT_MODEL_NAMES,
    is_hf_unless_quantized,
    map_hf_weights,
)

# Hugging Face name prefix -> ours: transformers' module tree (the Hub's -HF
# checkpoints). transformers 5's save_pretrained writes our names already (only the patch
# convolution's layout differs), so names alone cannot tell its checkpoints from a float
# conversion: see ``is_hf_checkpoint``.
HF_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    PROJECTOR_NAMES,
    TEXT_MODEL_NAMES,
    LM_HEAD_NAMES,
)
TOWER = "vision_tower."
LM_HEAD = "language_model.lm_head.weight"
# Tensors transformers keeps that inference never reads (masked image modelling).
UNUSED_TOWER_WEIGHTS = ("embeddings.mask_token",)
# Mixture-of-experts text models whose experts ``sanitize`` maps onto mlx-lm's: Qwen3-MoE
# (InternVL3.5-30B-A3B's and -241B-A28B's).
EXPERT_TEXT_MODELS = ("qwen3_moe",)


@dataclass(frozen=True)
class ModelArgs:
    text: Any  # mlx-lm ModelArgs of the text model
    vision: intern_vit.InternVisionConfig
    image_token_id: int
    image_seq_length: int  # tokens per tile
    shuffle: int  # 1 / downsample_ratio: the side of a square of patches folded into one token
    projector_hidden_act: str
    vision_feature_layer: int
    vision_feature_select_strategy: str  # "default": drop the class token; "full": keep it
    max_context: int | None

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        """From the config as transformers reads it (InternVLConfig's defaults, the text
        model's by its own model_type, ``tie_word_embeddings`` at the top level)."""
        config = as_transformers_reads_it({**config, "model_type": "internvl"})
        text = dict(config["text_config"])
        experts = text.get("num_experts") or text.get("num_local_experts")
        if experts and text["model_type"] not in EXPERT_TEXT_MODELS:
            # GPT-OSS: mlx-lm's gpt_oss Model takes no input embeddings, its YaRN rounds the
            # correction range that transformers' (``truncate: false``) keeps, and its
            # experts (interleaved gate/up, (experts, in, out), biases) need a mapping
            raise NotImplementedError(
                f"InternVL with a {text['model_type']} mixture-of-experts text model "
                "(InternVL3_5-GPT-OSS-20B-A4B-Preview-HF) is not supported yet"
            )
        text["rope_parameters"] = rope_parameters(text, 10_000.0)
        text["tie_word_embeddings"] = bool(config["tie_word_embeddings"])
        vision = intern_vit.InternVisionConfig.from_hf(config["vision_config"])
        ratio = float(config["downsample_ratio"])
        shuffle = round(1 / ratio)
        if abs(shuffle * ratio - 1) > 1e-6 or vision.patches_per_side % shuffle:
            raise NotImplementedError(
                f"InternVL with downsample_ratio {ratio} over a {vision.patches_per_side}-patch "
                "grid (the pixel shuffle needs a whole fraction that divides the grid)"
            )
        layer = config["vision_feature_layer"]
        if not isinstance(layer, int):
            raise NotImplementedError(f"InternVL with several vision feature layers ({layer})")
        strategy = config["vision_feature_select_strategy"]
        if strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}")
        activation(config["projector_hidden_act"])  # refuses an unsupported one now
        return cls(
            text=mlx_lm_backbone.model_args(text),
            vision=vision,
            image_token_id=config["image_token_id"],
            image_seq_length=(vision.patches_per_side // shuffle) ** 2,
            shuffle=shuffle,
            projector_hidden_act=config["projector_hidden_act"],
            vision_feature_layer=layer,
            vision_feature_select_strategy=strategy,
            max_context=mlx_lm_backbone.max_context(text),
        )


class MultiModalProjector(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.vision.hidden_size * args.shuffle**2
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, args.text.hidden_size)
        self.act = activation(args.projector_hidden_act)
        self.linear_2 = nn.Linear(args.text.hidden_size, args.text.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class Model(mlx_lm_backbone.MlxLmDecoder, VisionLanguageModel):
    feature_names = ("pixel_values",)
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = intern_vit.InternVisionModel(args.vision)
        self.multi_modal_projector = MultiModalProjector(args)
        self.language_model = mlx_lm_backbone.text_model(args.text)

    # -- checkpoint and processor -----------------------------------------------------

    @classmethod
    def is_hf_checkpoint(cls, weight_names) -> bool:
        """Hugging Face's unless quantized (see ``weights.is_hf_unless_quantized``)."""
        return is_hf_unless_quantized(weight_names, lambda n: cls.hf_to_mlx_name(n) != n)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        def tower_weight(name: str, value: mx.array) -> mx.array | None:
            if name in UNUSED_TOWER_WEIGHTS:
                return None
            return intern_vit.convert_hf_weight(name, value)

        mapped = map_hf_weights(
            weights, self.hf_to_mlx_name, towers={TOWER: tower_weight},
            drop={LM_HEAD} if self.args.text.tie_word_embeddings else (),
        )
        if getattr(self.args.text, "num_experts", 0):
            # the Hub's one tensor per expert (what transformers 5 saves too), or transformers
            # 5's in-memory fused (experts, out, in) tensors, as mlx-lm's switch_mlp
            mapped = split_experts(stack_expert_modules(mapped), self.args.text, True)
        return mapped

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        """transformers' InternVLProcessor over the checkpoint's tokenizer (which names
        ``<img>``, ``</img>``, ``<IMG_CONTEXT>`` and ``<video>`` as its
        ``start_image_token``, ``end_image_token``, ``context_image_token`` and
        ``video_token``), the PIL ``GotOcr2ImageProcessorPil`` and mlxvlm's numpy video
        processor; ``image_seq_length`` from processor_config.json, else from the model's
        sizes (what the tower gives per tile)."""
        from transformers import GotOcr2ImageProcessorPil, InternVLProcessor

        model_path = Path(model_path)
        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        missing = [name for name in ("start_image_token", "end_image_token",
                                     "context_image_token", "video_token")
                   if getattr(tokenizer, name, None) is None]
        if missing:
            raise ValueError(
                f"the checkpoint's tokenizer names no {', '.join(missing)} (InternVL's "
                "processor needs them: the -HF checkpoints' tokenizer_config.json lists them "
                "under extra_special_tokens)"
            )
        options = {}
        if config:
            options["image_seq_length"] = ModelArgs.from_hf(config).image_seq_length
        options.update(_processor_options(model_path))
        return image_only(InternVLProcessor)(
            image_processor=GotOcr2ImageProcessorPil.from_pretrained(model_path),
            tokenizer=tokenizer,
            video_processor=InternVLVideoProcessor.from_pretrained(model_path),
            chat_template=chat_template,
            **options,
        )

    # -- the contract -----------------------------------------------------------------

    # layers, max_context, make_cache and __call__: the mlx-lm decoder's (MlxLmDecoder)

    def embed(self, input_ids: mx.array, pixel_values: Any = None) -> tuple[mx.array, None]:
        features = None
        if pixel_values is not None:
            features = self.image_features(mx.array(pixel_values))
        h, _ = merge.embed_with_features(
            self.language_model.model.embed_tokens, input_ids, self.args.image_token_id,
            features, "<IMG_CONTEXT> tokens",
        )
        return h, None

    def image_features(self, pixel_values: mx.array) -> mx.array:
        """(tiles, C, H, W) tiles of all images and video frames, in prompt order ->
        (tiles * image_seq_length, text width). Each tile is encoded on its own, so tiles
        seen before come from the model's feature cache."""
        args = self.args

        def encode(tiles: mx.array) -> mx.array:
            dtype = self.vision_tower.embeddings.cls_token.dtype
            h = self.vision_tower.hidden_state(
                tiles.transpose(0, 2, 3, 1).astype(dtype), args.vision_feature_layer
            )
            if args.vision_feature_select_strategy == "default":
                h = h[:, 1:]  # the class token
            side = args.vision.patches_per_side
            return self.multi_modal_projector(pixel_shuffle(h, side, side, args.shuffle))

        return cached_rows(self, "image tile", encode, pixel_values).reshape(
            -1, args.text.hidden_size
        )


def _processor_options(model_path: Path) -> dict:
    """InternVLProcessor's own settings (``image_seq_length``) from processor_config.json;
    transformers 5 nests the sub-processors' settings there too, built separately."""
    path = model_path / "processor_config.json"
    options = json.loads(path.read_text()) if path.exists() else {}
    return {k: v for k, v in options.items()
            if k == "image_seq_length" and v is not None}


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
