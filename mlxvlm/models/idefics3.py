"""Idefics3 (Laurençon et al., 2024) and SmolVLM (Marafioti et al., 2025): the processor
cuts an image into tiles of the vision encoder's size plus a downscaled global view; a
SigLIP encoder embeds each tile, a pixel-shuffle connector folds every s x s block of patch
features into one token (s = ``scale_factor``) and projects it, and the tokens replace the
``<image>`` placeholders ahead of a Llama decoder (mlx-lm's, through its input embeddings).

SmolVLM (``model_type: smolvlm``) is the same model with another name; only its processor
class differs, and it builds the same prompts for images.

Checkpoint names (as mlx-community publishes them): ``vision_model.*``, ``connector.*`` and
``language_model.*`` (embed_tokens, layers, norm, lm_head).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it, rope_parameters
from mlxvlm.models.feature_cache import cached_rows
from mlxvlm.models.layers import mlx_lm_backbone, siglip
from mlxvlm.models.layers.pixel_shuffle import fold_blocks
from mlxvlm.models.processor_utils import pil_processor
from mlxvlm.models.weights import LM_HEAD_NAMES, map_hf_weights, tie_lm_head

# Hugging Face name prefix -> ours (the Hub's checkpoints and transformers 5 name them alike).
HF_PREFIXES = (
    ("model.vision_model.", "vision_model."),
    ("model.connector.", "connector."),
    ("model.text_model.", "language_model."),
    LM_HEAD_NAMES,
)
VISION_MODEL = "vision_model."
LM_HEAD = "language_model.lm_head.weight"
EMBED_TOKENS = "language_model.embed_tokens.weight"


@dataclass(frozen=True)
class ModelArgs:
    text: llama.ModelArgs
    vision: siglip.SiglipVisionConfig
    scale_factor: int
    image_token_id: int

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        """From either config layout, read through transformers' own config classes: the
        Hub's text_config may leave out Llama's defaults (SmolVLM2's has no head count)."""
        config = as_transformers_reads_it(config)
        text = dict(config["text_config"])
        text["rope_parameters"] = rope_parameters(text, 10_000.0)
        text["tie_word_embeddings"] = bool(config["tie_word_embeddings"])
        if text["model_type"] != "llama":
            raise NotImplementedError(
                f"{config['model_type']} with a {text['model_type']!r} text model is not "
                "supported (only llama)"
            )
        return cls(
            text=mlx_lm_backbone.model_args(text),
            vision=siglip.SiglipVisionConfig.from_hf(config["vision_config"]),
            scale_factor=config["scale_factor"],
            image_token_id=config["image_token_id"],
        )


class Connector(nn.Module):
    """Pixel shuffle, then a linear projection to the text width."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.scale_factor = args.scale_factor
        width = args.vision.hidden_size * args.scale_factor**2
        self.modality_projection = ModalityProjection(width, args.text.hidden_size)

    def __call__(self, patches: mx.array) -> mx.array:
        """(tiles, side * side, D) -> (tiles, (side / s)^2, text width). Each token holds an
        s x s block of patches, row by row: [(r, c) for r in block rows for c in block
        columns], as transformers' ``pixel_shuffle`` lays them out."""
        side = int(patches.shape[1] ** 0.5)
        return self.modality_projection(fold_blocks(patches, side, side, self.scale_factor))


class ModalityProjection(nn.Module):
    def __init__(self, width: int, text_width: int):
        super().__init__()
        self.proj = nn.Linear(width, text_width, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)


class LanguageModel(llama.LlamaModel):
    """mlx-lm's Llama decoder with its LM head beside the blocks (mlx-community's names)."""

    def __init__(self, args: llama.ModelArgs):
        super().__init__(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


class Model(VisionLanguageModel):
    feature_names = ("pixel_values", "pixel_attention_mask")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_model = siglip.SiglipVisionTransformer(args.vision)
        self.connector = Connector(args)
        self.language_model = LanguageModel(args.text)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        sanitized = map_hf_weights(
            weights, self.hf_to_mlx_name, towers={VISION_MODEL: siglip.convert_hf_weight}
        )
        return tie_lm_head(sanitized, LM_HEAD, EMBED_TOKENS)

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        """transformers' Idefics3Processor with the PIL image processor (no torchvision).

        SmolVLM's own processor (video: each frame a tile after its timestamp) gets
        mlxvlm's numpy video processor; it needs num2words (the prompt spells the frame
        count), without which SmolVLM checkpoints get Idefics3's processor -- the same
        image prompts and processing -- and take no video."""
        smolvlm = config.get("model_type") == "smolvlm"
        image_processor = "SmolVLMImageProcessorPil" if smolvlm else "Idefics3ImageProcessorPil"
        if smolvlm and _spells_numbers():
            return smolvlm_processor(model_path)
        return pil_processor(model_path, "Idefics3Processor", image_processor)

    # -- the contract -----------------------------------------------------------------

    def embed(
        self, input_ids: mx.array, pixel_values: Any = None, pixel_attention_mask: Any = None
    ) -> tuple[mx.array, None]:
        features = None
        if pixel_values is not None:
            features = self.image_features(pixel_values, pixel_attention_mask)
        h, _ = merge.embed_with_features(
            self.language_model.embed_tokens, input_ids, self.args.image_token_id, features,
            "<image> tokens",
        )
        return h, None

    def image_features(self, pixel_values: Any, pixel_attention_mask: Any = None) -> mx.array:
        """(tiles, tokens per tile, text width) from the processor's (1, tiles, C, H, W)
        pixels (padding tiles, all zeros, are dropped as transformers drops them) and
        (1, tiles, H, W) pixel mask."""
        pixels = np.asarray(pixel_values, dtype=np.float32)
        pixels = pixels.reshape(-1, *pixels.shape[-3:])
        real = pixels.reshape(pixels.shape[0], -1).any(axis=1)
        pixels = pixels[real]
        p = self.args.vision.patch_size
        rows, columns = pixels.shape[-2] // p, pixels.shape[-1] // p
        if pixel_attention_mask is None:
            patch_mask = np.ones((pixels.shape[0], rows, columns), dtype=bool)
        else:
            mask = np.asarray(pixel_attention_mask).reshape(-1, *pixels.shape[-2:])[real]
            mask = mask[:, : rows * p, : columns * p].reshape(-1, rows, p, columns, p)
            patch_mask = mask.any(axis=(2, 4))
        dtype = self.vision_model.post_layernorm.weight.dtype  # never quantized

        def encode(tiles: np.ndarray, masks: np.ndarray) -> mx.array:  # tile by tile
            tiles = mx.array(tiles.transpose(0, 2, 3, 1)).astype(dtype)
            return self.connector(self.vision_model(tiles, masks))

        return cached_rows(self, "image tile", encode, pixels, patch_mask)

    def __call__(
        self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False
    ) -> mx.array:
        h = self.language_model(input_ids, cache, input_embeddings=embeddings)
        return self.language_model.lm_head(h[:, -1:] if last_only else h)


def _spells_numbers() -> bool:
    import importlib.util

    return importlib.util.find_spec("num2words") is not None


def smolvlm_processor(model_path: str | Path):
    """transformers' SmolVLMProcessor over the tokenizer, the PIL image processor and
    mlxvlm's numpy video processor, with the checkpoint's settings."""
    import transformers

    from mlxvlm.models.processor_utils import image_only, read_chat_template
    from mlxvlm.models.smolvlm_video import SmolVLMVideoProcessor

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    options = {}
    config = Path(model_path) / "processor_config.json"
    if config.exists():
        options = {k: v for k, v in json.loads(config.read_text()).items()
                   if k == "image_seq_len"}
    return image_only(transformers.SmolVLMProcessor)(
        image_processor=transformers.SmolVLMImageProcessorPil.from_pretrained(model_path),
        tokenizer=tokenizer,
        video_processor=SmolVLMVideoProcessor.from_pretrained(model_path),
        chat_template=read_chat_template(model_path) or tokenizer.chat_template,
        **options,
    )


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
