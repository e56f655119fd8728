"""Pixtral (Mistral AI, 2024): the Pixtral vision transformer, LLaVA's two-layer projector
and a Mistral decoder (mlx-lm's, through ``input_embeddings``).

On the Hub (mistral-community/pixtral-12b) the checkpoint is a ``llava`` config whose
``vision_config.model_type`` is ``pixtral``; mlx-community's conversions are registered
here as ``pixtral``. ``Model.from_config``, ``is_hf_checkpoint`` and ``load_processor``
take either, so the ``llava`` family can hand over any config for which
``is_pixtral_config`` holds.

Each image becomes rows of ``[IMG]`` tokens, one per patch, each row closed by
``[IMG_BREAK]`` and the last by ``[IMG_END]``; only the ``[IMG]`` tokens carry image
features. transformers' ``PixtralProcessor`` cannot be imported without torchvision, so
``PixtralProcessor`` below is the same expansion over the tokenizer and transformers' PIL
image processor (tests check it against transformers' own).

Checkpoint names (mlx-community's): ``vision_tower.vision_model.*``,
``multi_modal_projector.linear_{1,2}``, ``language_model.model.*``,
``language_model.lm_head`` unless tied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from transformers import ProcessorMixin

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import (
    rope_parameters,
    tie_word_embeddings,
    token_id,
    vision_config,
)
from mlxvlm.models.feature_cache import cached_features
from mlxvlm.models.layers import mlx_lm_backbone
from mlxvlm.models.layers.pixtral_vision import (
    PixtralVisionConfig,
    PixtralVisionTower,
    sanitize_vision_tensor,
)
from mlxvlm.models.layers.activations import activation
from mlxvlm.models.processor_utils import tokenizer_and_chat_template
from mlxvlm.models.weights import (
    LM_HEAD_NAMES,
    PROJECTOR_NAMES,
    TEXT_MODEL_NAMES,
    TOWER_MODULE_TREE,
    TOWER_SAVED,
    has_transformers_names,
    map_hf_weights,
)

# Hugging Face name prefix -> ours, the longest match wins. Hub checkpoints (transformers
# 4.4x-4.5x) already use ``language_model.model.*`` / ``multi_modal_projector.*`` and put
# the tower directly under ``vision_tower.``; transformers 5 nests them all under
# ``model.``, which is listed first: adapters are named after that module tree.
HF_PREFIXES = (TOWER_MODULE_TREE, TOWER_SAVED, PROJECTOR_NAMES, TEXT_MODEL_NAMES, LM_HEAD_NAMES)
VISION_TOWER = "vision_tower.vision_model."
LM_HEAD = "language_model.lm_head.weight"

def is_pixtral_config(config: dict) -> bool:
    """Whether a config (``pixtral``, or the Hub's ``llava`` one) has a Pixtral tower: the
    test by which ``llava`` hands such a checkpoint to this family."""
    return (config.get("vision_config") or {}).get("model_type") == "pixtral"


def text_config_for_mlx_lm(config: dict) -> dict:
    """The text config, complete for mlx-lm's Mistral/Llama, in either layout.

    The Hub's sub-configs name only what differs from the defaults (mistral-community/
    pixtral-12b's has no num_attention_heads), so the text config is read through its
    transformers class. The head is tied as the composite config says (see config_utils:
    transformers 5's Mistral3Config defaults to tied, Mistral Small's weights are not).
    """
    from transformers import CONFIG_MAPPING

    sub = dict(config.get("text_config") or {})
    sub.setdefault("model_type", "mistral")
    text = CONFIG_MAPPING[sub["model_type"]](**sub).to_dict()
    text["rope_parameters"] = rope_parameters(text, 10000.0)
    text["tie_word_embeddings"] = tie_word_embeddings(config)
    return text


@dataclass
class ModelArgs:
    vision: PixtralVisionConfig
    text: Any  # mlx-lm's ModelArgs
    image_token_id: int
    vision_feature_layer: int | tuple[int, ...]
    projector_hidden_act: str
    projector_bias: bool
    max_context: int | None


class PixtralFamilyModel(mlx_lm_backbone.MlxLmDecoder, VisionLanguageModel):
    """Pixtral tower + a projector + an mlx-lm text model; subclasses add the projector."""

    feature_names = ("pixel_values", "image_sizes")
    hf_prefixes = HF_PREFIXES

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = PixtralVisionTower(args.vision)
        self.language_model = mlx_lm_backbone.text_model(args.text)

    # -- checkpoint and processor -----------------------------------------------------

    @classmethod
    def is_hf_checkpoint(cls, weight_names: Iterable[str]) -> bool:
        """Hugging Face names: the tower directly under ``vision_tower.`` (ours nest it
        under ``vision_tower.vision_model.``), or transformers 5's ``model.`` / ``lm_head.``."""
        return has_transformers_names(weight_names, ours=VISION_TOWER)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return map_hf_weights(
            weights, self.hf_to_mlx_name, towers={VISION_TOWER: sanitize_vision_tensor},
            drop={LM_HEAD} if self.args.text.tie_word_embeddings else (),
        )

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        """Tokenizer + transformers' PIL Pixtral image processor + the checkpoint's token
        expansion settings (processor_config.json) and chat template."""
        from transformers import PixtralImageProcessorPil

        model_path = Path(model_path)
        settings = {}
        processor_config = model_path / "processor_config.json"
        if processor_config.exists():
            settings = json.loads(processor_config.read_text())
        vision = vision_config(config)
        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        merge_size = config.get("spatial_merge_size", 1)
        return PixtralProcessor(
            image_processor=PixtralImageProcessorPil.from_pretrained(model_path),
            tokenizer=tokenizer,
            patch_size=settings.get("patch_size", vision.get("patch_size", 16)),
            spatial_merge_size=settings.get("spatial_merge_size", merge_size),
            chat_template=chat_template,
            image_token=settings.get("image_token", "[IMG]"),
            image_break_token=settings.get("image_break_token", "[IMG_BREAK]"),
            image_end_token=settings.get("image_end_token", "[IMG_END]"),
        )

    # -- the contract -----------------------------------------------------------------

    # layers, max_context, make_cache and __call__: the mlx-lm decoder's (MlxLmDecoder)

    def embed(self, input_ids: mx.array, pixel_values: Any = None, image_sizes: Any = None):
        features = None
        if pixel_values is not None:
            pixels = pixel_values if isinstance(pixel_values, mx.array) else mx.array(pixel_values)
            features = mx.concatenate(self.image_features(pixels, image_sizes), axis=0)
        h, _ = merge.embed_with_features(
            self.language_model.model.embed_tokens, input_ids, self.args.image_token_id, features
        )
        return h, None

    def image_features(self, pixels: mx.array, image_sizes: Any) -> list[mx.array]:
        """Per image, its projected tokens: the tower runs on each image at its own size
        (its ``image_sizes`` crop of the padded batch), so images seen before come from
        the model's feature cache."""
        sizes = np.asarray(image_sizes).reshape(-1, 2)
        patch = self.args.vision.patch_size
        crops = [
            (image[:, : int(h) // patch * patch, : int(w) // patch * patch], size)
            for image, (h, w), size in zip(pixels, sizes.tolist(), sizes)
        ]

        def encode(indices: list[int]) -> list[tuple[mx.array]]:
            batch = pixels if len(indices) == len(sizes) else pixels[mx.array(indices)]
            per_image = self.vision_tower(batch, sizes[indices], self.args.vision_feature_layer)
            return [(f,) for f in self.project(per_image, sizes[indices])]

        return [f for (f,) in cached_features(self, "image", crops, encode)]

    def project(self, per_image: list[mx.array], image_sizes: np.ndarray) -> list[mx.array]:
        raise NotImplementedError

    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        text = text_config_for_mlx_lm(config)
        feature_layer = config.get("vision_feature_layer", -1)
        return ModelArgs(
            vision=PixtralVisionConfig.from_hf(vision_config(config)),
            text=mlx_lm_backbone.model_args(text),
            image_token_id=token_id(config, "image_token", 10),
            vision_feature_layer=feature_layer if isinstance(feature_layer, int) else tuple(feature_layer),
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
            projector_bias=config.get("multimodal_projector_bias", True),
            max_context=mlx_lm_backbone.max_context(text),
        )


class LlavaProjector(nn.Module):
    """LLaVA's ``multi_modal_projector``: linear -> activation -> linear."""

    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)
        self.act = activation(act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(self.act(self.linear_1(x)))


def num_feature_layers(feature_layer: int | tuple[int, ...]) -> int:
    return 1 if isinstance(feature_layer, int) else len(feature_layer)


class Model(PixtralFamilyModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        width = args.vision.hidden_size * num_feature_layers(args.vision_feature_layer)
        self.multi_modal_projector = LlavaProjector(
            width, args.text.hidden_size, args.projector_hidden_act, args.projector_bias
        )

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        strategy = config.get("vision_feature_select_strategy", "full")
        if strategy != "full":
            raise NotImplementedError(
                f"vision_feature_select_strategy {strategy!r} with a Pixtral tower (which has "
                "no CLS token to drop) is not supported; Pixtral checkpoints use 'full'"
            )
        return cls(cls.model_args(config))

    def project(self, per_image, image_sizes):
        return [self.multi_modal_projector(f) for f in per_image]


# ---------------------------------------------------------------------------- processor


class PixtralProcessor(ProcessorMixin):
    """transformers' PixtralProcessor (its module needs torchvision): each image in the
    text becomes rows of ``[IMG]`` * (width / unit) + ``[IMG_BREAK]``, the last break
    replaced by ``[IMG_END]``, where unit = patch_size * spatial_merge_size pixels."""

    def __init__(
        self,
        image_processor=None,
        tokenizer=None,
        patch_size: int = 16,
        spatial_merge_size: int = 1,
        chat_template=None,
        image_token: str = "[IMG]",
        image_break_token: str = "[IMG_BREAK]",
        image_end_token: str = "[IMG_END]",
        **kwargs,
    ):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.patch_size = patch_size
        self.spatial_merge_size = spatial_merge_size
        self.image_token = image_token
        self.image_break_token = image_break_token
        self.image_end_token = image_end_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)

    def _process_images(self, images, **images_kwargs):
        # The image processor sizes images in whole merged tokens.
        images_kwargs["patch_size"] = self.patch_size * self.spatial_merge_size
        return super()._process_images(images, **images_kwargs)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        unit = self.patch_size * self.spatial_merge_size
        height, width = image_inputs["image_sizes"][image_idx]
        row = self.image_token * (int(width) // unit) + self.image_break_token
        tokens = row * (int(height) // unit)
        return tokens[: -len(self.image_break_token)] + self.image_end_token

    @property
    def model_input_names(self):
        return self.tokenizer.model_input_names + self.image_processor.model_input_names


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
