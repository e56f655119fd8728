"""LLaVA 1.5 (Liu et al., 2023): a CLIP vision tower, a two-layer MLP projector and a
stock LLM decoder. The hidden states of one (or several, concatenated) vision block(s)
are projected to the text width and replace the prompt's ``<image>`` placeholders,
one token per patch (the class token is dropped under the ``"default"`` strategy).

Checkpoint names (the Hub's original ones, which mlx-community's conversions keep):
``vision_tower.vision_model.*``, ``multi_modal_projector.linear_{1,2}.*``,
``language_model.model.*`` and ``language_model.lm_head.*`` (unless tied). LLaVA-NeXT and
LLaVA-OneVision extend this module; ``llava`` checkpoints with a Pixtral tower go to the
``pixtral`` family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it, rope_parameters
from mlxvlm.models.feature_cache import cached_rows
from mlxvlm.models.layers import mlx_lm_backbone
from mlxvlm.models.layers import siglip
from mlxvlm.models.layers.activations import activation
from mlxvlm.models.layers.clip import CLIPVisionConfig, CLIPVisionModel
from mlxvlm.models.processor_utils import image_only, tokenizer_and_chat_template
from mlxvlm.models.weights import (
    LM_HEAD_NAMES,
    NESTED_TOWER_NAMES,
    PROJECTOR_NAMES,
    TEXT_MODEL_NAMES,
    is_hf_unless_quantized,
    map_hf_weights,
)

# --------------------------------------------------------------------------- checkpoints
#
# Three namings of the same tensors reach ``sanitize``:
#   1. the Hub's original checkpoints (llava-hf/*), which are also mlx-community's names:
#      language_model.model.*, language_model.lm_head.*, vision_tower.vision_model.*,
#      multi_modal_projector.*, image_newline;
#   2. transformers 5's save_pretrained: as 1, but the vision tower without its
#      ``vision_model.`` level (vision_tower.embeddings.*, vision_tower.encoder.*);
#   3. the module tree (transformers >= 4.52 saves): model.language_model.*, lm_head.*,
#      model.vision_tower.*, model.multi_modal_projector.*, model.image_newline.
# Names alone cannot tell 1 from an unquantized mlx-community conversion (only the patch
# embedding's layout differs). The loader recognises conversions by how their writer
# marked them (safetensors metadata ``format: mlx`` from mlx-lm, mlx-vlm and
# mlxvlm.convert; mlxvlm.convert's config marker) before asking ``is_hf_checkpoint``,
# which therefore takes 1's names for the Hub's, unless the tensors are quantized.

# 2's tower is nested under ours by the table's TOWER_SAVED entry (see models/weights.py).
HF_PREFIXES = (
    TEXT_MODEL_NAMES,
    LM_HEAD_NAMES,
    *NESTED_TOWER_NAMES,
    PROJECTOR_NAMES,
    ("model.image_newline", "image_newline"),
)
TOWER = "vision_tower.vision_model."
LM_HEAD = "language_model.lm_head.weight"
# Buffers some Hugging Face checkpoints carry and that are recomputed here.
HF_ONLY_SUFFIXES = ("position_ids", "rotary_emb.inv_freq")


# ------------------------------------------------------------------------ towers, config


class SiglipTower(siglip.SiglipVisionModel):
    """SigLIP as a LLaVA tower (llava-interleave, OneVision): no class token."""

    has_class_token = False
    convert_hf_weight = staticmethod(siglip.convert_hf_weight)

    def hidden_states(self, pixel_values: mx.array, layers) -> list[mx.array]:
        """Hidden states at ``layers`` as transformers indexes them (see CLIP's)."""
        _, states = self(pixel_values, output_hidden_states=True)
        return [states[layer] for layer in layers]


# vision_config's model_type -> (its config class, the tower)
VISION_TOWERS: dict[str, tuple[type, type]] = {
    "clip_vision_model": (CLIPVisionConfig, CLIPVisionModel),
    "siglip_vision_model": (siglip.SiglipVisionConfig, SiglipTower),
}


def vision_config_from_hf(vision: dict):
    model_type = vision.get("model_type")
    if model_type not in VISION_TOWERS:
        raise NotImplementedError(
            f"vision tower {model_type!r} is not supported for LLaVA models "
            f"(supported: {sorted(VISION_TOWERS)})"
        )
    return VISION_TOWERS[model_type][0].from_hf(vision)


def vision_tower_class(vision_config) -> type:
    for config_class, tower_class in VISION_TOWERS.values():
        if isinstance(vision_config, config_class):
            return tower_class
    raise TypeError(f"no vision tower takes a {type(vision_config).__name__}")


def is_pixtral_config(config: dict) -> bool:
    """The Hub's Pixtral (mistral-community/pixtral-12b) is a ``llava`` config with a
    Pixtral tower; the ``pixtral`` family implements it, so this one hands it over."""
    return (config.get("vision_config") or {}).get("model_type") == "pixtral"


def text_config_from_hf(config: dict) -> dict:
    """The text config of a config read by ``as_transformers_reads_it``, whose top-level
    ``tie_word_embeddings`` is resolved (the composite's flag or the text model's own)."""
    text = dict(config["text_config"])
    text["rope_parameters"] = rope_parameters(text, 10000.0)
    text["tie_word_embeddings"] = bool(config["tie_word_embeddings"])
    return text


@dataclass(frozen=True)
class ModelArgs:
    text: Any  # mlx-lm ModelArgs of the text model
    vision: Any  # the vision tower's config (CLIPVisionConfig, ...)
    image_token_id: int
    vision_feature_layers: tuple[int, ...]
    vision_feature_select_strategy: str  # "default": drop the class token; "full": keep it
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    max_context: int | None = None
    # LLaVA-NeXT / OneVision only
    image_grid_pinpoints: tuple[tuple[int, int], ...] = field(default=())
    vision_aspect_ratio: str | None = None
    video_token_id: int | None = None  # OneVision

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        config = as_transformers_reads_it(config)
        text = text_config_from_hf(config)
        vision = vision_config_from_hf(config["vision_config"])
        layers = config["vision_feature_layer"]
        strategy = config["vision_feature_select_strategy"]
        if strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}")
        return cls(
            text=mlx_lm_backbone.model_args(text),
            vision=vision,
            image_token_id=config["image_token_index"],
            vision_feature_layers=(layers,) if isinstance(layers, int) else tuple(layers),
            vision_feature_select_strategy=strategy,
            projector_hidden_act=config["projector_hidden_act"],
            projector_bias=config.get("multimodal_projector_bias", True),
            max_context=mlx_lm_backbone.max_context(text),
            image_grid_pinpoints=tuple(
                tuple(p) for p in config.get("image_grid_pinpoints") or ()
            ),
            vision_aspect_ratio=config.get("vision_aspect_ratio"),
            video_token_id=config.get("video_token_index"),
        )


# -------------------------------------------------------------------------------- model


class MultiModalProjector(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.text.hidden_size
        vision_width = args.vision.hidden_size * len(args.vision_feature_layers)
        self.linear_1 = nn.Linear(vision_width, width, bias=args.projector_bias)
        self.act = activation(args.projector_hidden_act)
        self.linear_2 = nn.Linear(width, width, bias=args.projector_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(self.act(self.linear_1(x)))


class Model(mlx_lm_backbone.MlxLmDecoder, VisionLanguageModel):
    feature_names = ("pixel_values",)
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    processor_class = "LlavaProcessor"

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = vision_tower_class(args.vision)(args.vision)
        self.multi_modal_projector = MultiModalProjector(args)
        self.language_model = mlx_lm_backbone.text_model(args.text)

    @classmethod
    def from_config(cls, config: dict) -> VisionLanguageModel:
        if is_pixtral_config(config):
            from mlxvlm.models import pixtral

            return pixtral.Model.from_config(config)
        return super().from_config(config)

    # -- checkpoint and processor -----------------------------------------------------

    @classmethod
    def is_hf_checkpoint(cls, weight_names: Iterable[str]) -> bool:
        """Whether tensors are named and laid out as in Hugging Face checkpoints (else:
        MLX's). Quantized tensors mean an MLX conversion. Otherwise the names are Hugging
        Face's — unmistakably (the module-tree or save_pretrained namings, buffers that
        conversions drop) or as the Hub's original checkpoints, whose names conversions
        keep (see above)."""
        return is_hf_unless_quantized(
            weight_names, lambda n: n.endswith(HF_ONLY_SUFFIXES) or cls.hf_to_mlx_name(n) != n
        )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return map_hf_weights(
            weights, self.hf_to_mlx_name, towers={TOWER: self.vision_tower.convert_hf_weight},
            skip_suffixes=HF_ONLY_SUFFIXES,
            drop={LM_HEAD} if self.args.text.tie_word_embeddings else (),
        )

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        """The transformers processor (tokenizer + PIL image processor + chat template),
        built without torch. Settings missing from processor_config.json (older Hub
        checkpoints) come from the model's config (``default_processor_options``), so
        that the placeholders match what the tower gives."""
        if is_pixtral_config(config):
            from mlxvlm.models import pixtral

            return pixtral.Model.load_processor(model_path, config)

        from transformers import AutoImageProcessor

        model_path = Path(model_path)
        processor_class = cls.processor_type()
        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        image_processor = AutoImageProcessor.from_pretrained(model_path, backend="pil")
        options = cls.default_processor_options(config)
        options.update(_processor_options(model_path))
        kwargs = dict(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)
        if "video_processor" in processor_class.get_attributes():
            processor_class = image_only(processor_class)  # no torchvision video processor
            kwargs["video_processor"] = cls.load_video_processor(model_path)
        return processor_class(**kwargs, **options)

    @classmethod
    def load_video_processor(cls, model_path: Path):
        """mlxvlm's numpy video processor for the checkpoint; None: no video input."""
        return None

    @classmethod
    def processor_type(cls) -> type:
        """The transformers processor class ``processor_class`` names."""
        import transformers

        return getattr(transformers, cls.processor_class)

    @classmethod
    def default_processor_options(cls, config: dict) -> dict:
        """What LlavaProcessor/LlavaNextProcessor need to count an image's placeholders."""
        if not config:
            return {}
        args = ModelArgs.from_hf(config)
        has_class_token = vision_tower_class(args.vision).has_class_token
        return {
            "patch_size": args.vision.patch_size,
            "vision_feature_select_strategy": args.vision_feature_select_strategy,
            "num_additional_image_tokens": 1 if has_class_token else 0,
        }

    # -- the contract -----------------------------------------------------------------

    # layers, max_context, make_cache and __call__: the mlx-lm decoder's (MlxLmDecoder)

    def embed(self, input_ids: mx.array, pixel_values: Any = None, **features: Any):
        image_features = None
        if pixel_values is not None:
            pixel_values = mx.array(pixel_values) if not isinstance(pixel_values, mx.array) else pixel_values
            image_features = self.image_features(pixel_values, **features)
        h, _ = merge.embed_with_features(
            self.language_model.model.embed_tokens, input_ids, self.args.image_token_id,
            image_features, "image placeholder tokens",
        )
        return h, None

    # -- image features ---------------------------------------------------------------

    def tile_features(self, pixel_values: mx.array) -> mx.array:
        """(N, C, H, W) tiles -> (N, tokens, text width) projected features. The tower sees
        each tile on its own, so tiles seen before come from the model's feature cache."""

        def encode(tiles: mx.array) -> mx.array:
            states = self.vision_tower.hidden_states(
                tiles.transpose(0, 2, 3, 1), self.args.vision_feature_layers
            )
            selected = mx.concatenate(states, axis=-1)
            if self.args.vision_feature_select_strategy == "default":
                selected = selected[:, 1:]  # the class token
            return self.multi_modal_projector(selected)

        return cached_rows(self, "image tile", encode, pixel_values)

    def image_features(self, pixel_values: mx.array, **features: Any) -> mx.array:
        """All images' feature tokens, in prompt order: one per patch of each image."""
        return self.tile_features(pixel_values).reshape(-1, self.args.text.hidden_size)


# ---------------------------------------------------------------------------- processor


def _processor_options(model_path: Path) -> dict:
    """The processor's own settings (patch size, select strategy, ...) from
    processor_config.json, where both layouts keep them."""
    import json

    path = model_path / "processor_config.json"
    options = json.loads(path.read_text()) if path.exists() else {}
    # transformers 5 nests the sub-processors' configs there; they are built separately.
    # mlx-vlm's conversions write null for settings the source lacked: keep the defaults.
    return {
        k: v
        for k, v in options.items()
        if v is not None and not isinstance(v, dict) and k != "processor_class"
    }


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
