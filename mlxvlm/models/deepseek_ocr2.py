"""DeepSeek-OCR 2 (``deepseek_ocr2``, deepseek-community/DeepSeek-OCR-2): SAM's ViT
(``layers/sam_vision.py``) shrinks each view to a small map; a Qwen2 encoder reads that
map followed by learned queries -- the map's tokens attend to each other both ways, the
queries causally to the map and the queries before them -- and the queries' states,
projected to the text width, are the view's features. A page is a global view (1024 px:
256 queries) plus up to six 768-px tiles (144 queries each): its placeholders take the
tiles' features, then the global view's, then the learned ``view_separator``. The text
model is DeepSeek-MoE with multi-head attention (``layers/deepseek_moe_decoder.py``:
mlx-lm's ``deepseek`` blocks).

Prompts: the checkpoint's chat template, or -- the Hub's checkpoint is used with plain
prompts, ``processor(text="<image>\\nFree OCR.")`` -- ``CHAT_TEMPLATE``, which renders a
user turn as that plain text: each image part as ``<image>\\n``, then the text. So the
model card's modes are the user's text unchanged: "Free OCR.", "<|grounding|>Convert the
document to markdown." (the ``<|grounding|>`` token asks for ``<|ref|>``/``<|det|>``
boxes), "Parse the figure.", "Describe this image in detail.".

Checkpoints: transformers 5's names (``model.vision_tower.sam_encoder.*``, fused experts)
and the Hub's original ones (``model.sam_model.blocks.N.norm1``, ``model.qwen2_model.*``,
``model.projector.layers``, ``model.view_seperator``, one tensor per expert), which
transformers renames as it loads (``HUB_NAMES`` does the same).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import qwen2

from mlxvlm.errors import MlxvlmError
from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it, rope_parameters
from mlxvlm.models.feature_cache import cached_rows
from mlxvlm.models.layers import deepseek_moe_decoder, sam_vision
from mlxvlm.models.layers.sam_vision import SamVisionConfig, SamVisionEncoder
from mlxvlm.models.processor_utils import tokenizer_and_chat_template
from mlxvlm.models.weights import rename_prefix

# A user turn as the plain text the model card prompts with; an assistant turn's answer
# ends with EOS, as the model ends it.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<image>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}"
    "{%- elif message['role'] == 'system' -%}{{- '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
)

# The encoder's learned queries per view: 12 x 12 for a 768-px tile, 16 x 16 for the
# 1024-px global view (transformers' fixed sizes).
TILE_QUERIES, GLOBAL_QUERIES = 144, 256

# transformers 5's names -> ours (longest prefix first wins)
HF_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.view_separator", "view_separator"),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)

# The Hub's original names -> transformers 5's (the renames transformers' loader applies
# to ``deepseek_ocr2`` checkpoints, conversion_mapping.py), first match wins.
HUB_NAMES = (
    (r"sam_model\.blocks\.(\d+)\.norm1\.", r"vision_tower.sam_encoder.layers.\1.layer_norm1."),
    (r"sam_model\.blocks\.(\d+)\.norm2\.", r"vision_tower.sam_encoder.layers.\1.layer_norm2."),
    (r"sam_model\.blocks\.(\d+)\.", r"vision_tower.sam_encoder.layers.\1."),
    (r"sam_model\.patch_embed\.proj\.", "vision_tower.sam_encoder.patch_embed.projection."),
    (r"sam_model\.pos_embed", "vision_tower.sam_encoder.pos_embed"),
    (r"sam_model\.neck\.0\.", "vision_tower.sam_encoder.neck.conv1."),
    (r"sam_model\.neck\.1\.", "vision_tower.sam_encoder.neck.layer_norm1."),
    (r"sam_model\.neck\.2\.", "vision_tower.sam_encoder.neck.conv2."),
    (r"sam_model\.neck\.3\.", "vision_tower.sam_encoder.neck.layer_norm2."),
    (r"sam_model\.net_2\.", "vision_tower.sam_encoder.proj.conv1."),
    (r"sam_model\.net_3\.", "vision_tower.sam_encoder.proj.conv2."),
    (r"qwen2_model\.model\.model\.", "vision_tower.vision_encoder."),
    (r"qwen2_model\.query_768\.", "vision_tower.query_768_resolution."),
    (r"qwen2_model\.query_1024\.", "vision_tower.query_1024_resolution."),
    (r"projector\.layers\.", "multi_modal_projector."),
    (r"view_seperator", "view_separator"),
    (r"^model\.(embed_tokens|layers|norm)\.", r"model.language_model.\1."),
)
HUB_MARKERS = ("sam_model.", "qwen2_model.", "projector.layers.", "view_seperator")
# Buffers some checkpoints carry that are recomputed here.
HF_ONLY_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ModelArgs:
    sam: SamVisionConfig
    encoder: qwen2.ModelArgs
    text: Any  # mlx-lm deepseek.ModelArgs
    mlp_layer_types: tuple[str, ...]
    image_token_id: int

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        config = as_transformers_reads_it(config)
        vision = config["vision_config"]
        text = dict(config["text_config"])
        text["rope_parameters"] = rope_parameters(text, 10000.0)
        layer_types = text.get("mlp_layer_types")
        if layer_types is None:
            raise MlxvlmError("this DeepSeek-OCR 2 config has no text_config.mlp_layer_types "
                              "(which layers are dense and which mixtures of experts)")
        return cls(
            sam=sam_config(vision["sam_config"]),
            encoder=encoder_args(vision["encoder_config"]),
            text=deepseek_moe_decoder.model_args(text, layer_types),
            mlp_layer_types=tuple(layer_types),
            image_token_id=config["image_token_id"],
        )


def sam_config(sam: dict) -> SamVisionConfig:
    names = {f.name for f in fields(SamVisionConfig)}
    values = {k: v for k, v in sam.items() if k in names}
    values["global_attn_indexes"] = tuple(sam["global_attn_indexes"])
    values["downsample_channels"] = tuple(sam["downsample_channels"])
    for key in ("image_size", "patch_size"):
        if not isinstance(values[key], int):
            raise NotImplementedError(f"a non-square SAM {key} ({values[key]})")
    return SamVisionConfig(**values)


def encoder_args(encoder: dict) -> qwen2.ModelArgs:
    rope = rope_parameters(encoder, 10000.0)
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"DeepSeek-OCR 2 encoder RoPE type {rope['rope_type']!r}")
    if encoder.get("use_sliding_window"):
        raise NotImplementedError("a sliding-window DeepSeek-OCR 2 encoder")
    return qwen2.ModelArgs(
        model_type="qwen2", hidden_size=encoder["hidden_size"],
        num_hidden_layers=encoder["num_hidden_layers"],
        intermediate_size=encoder["intermediate_size"],
        num_attention_heads=encoder["num_attention_heads"],
        num_key_value_heads=encoder["num_key_value_heads"], rms_norm_eps=encoder["rms_norm_eps"],
        vocab_size=encoder["vocab_size"], rope_theta=float(rope["rope_theta"]),
        max_position_embeddings=encoder["max_position_embeddings"], tie_word_embeddings=False,
    )


# ------------------------------------------------------------------------------ tower


class QueryEncoder(nn.Module):
    """Qwen2 blocks over a view's map then its queries (mlx-lm's ``qwen2`` blocks)."""

    def __init__(self, args: qwen2.ModelArgs):
        super().__init__()
        self.layers = [qwen2.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, h: mx.array, num_patches: int) -> mx.array:
        length = h.shape[1]
        index = mx.arange(length)
        # causal, and the map's tokens see the whole map (transformers' block of ids 0)
        mask = (index[None, :] <= index[:, None]) | (
            (index[:, None] < num_patches) & (index[None, :] < num_patches))
        for layer in self.layers:
            h = layer(h, mask)
        return self.norm(h)


class VisionTower(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width = args.encoder.hidden_size
        self.sam_encoder = SamVisionEncoder(args.sam)
        self.vision_encoder = QueryEncoder(args.encoder)
        self.query_768_resolution = nn.Embedding(TILE_QUERIES, width)
        self.query_1024_resolution = nn.Embedding(GLOBAL_QUERIES, width)

    def __call__(self, pixels: mx.array) -> mx.array:
        """(N, H, W, C) views -> (N, queries, encoder width)."""
        patches = self.sam_encoder(pixels)
        count = patches.shape[1]
        queries = (self.query_768_resolution if count <= TILE_QUERIES
                   else self.query_1024_resolution).weight
        queries = mx.broadcast_to(queries[None].astype(patches.dtype),
                                  (patches.shape[0], *queries.shape))
        h = self.vision_encoder(mx.concatenate([patches, queries], axis=1), count)
        return h[:, count:]


# ------------------------------------------------------------------------------ model


class Model(VisionLanguageModel):
    feature_names = ("pixel_values", "pixel_values_local", "num_local_patches")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    processor_class = "DeepseekOcr2Processor"
    image_processor_class = "DeepseekOcr2ImageProcessorPil"

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = VisionTower(args)
        self.multi_modal_projector = nn.Linear(args.encoder.hidden_size, args.text.hidden_size)
        self.view_separator = mx.zeros((args.text.hidden_size,))
        self.language_model = deepseek_moe_decoder.DeepseekMoeLanguageModel(
            args.text, list(args.mlp_layer_types))

    @property
    def max_context(self) -> int | None:
        return self.args.text.max_position_embeddings

    # -- checkpoint and processor -----------------------------------------------------

    @classmethod
    def is_hf_checkpoint(cls, weight_names) -> bool:
        names = list(weight_names)
        if any(marker in name for name in names for marker in HUB_MARKERS):
            return True
        return super().is_hf_checkpoint(names)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        renamed = {}
        for name, value in weights.items():
            if name.endswith(HF_ONLY_SUFFIXES):
                continue
            name = hub_to_transformers_name(name)
            if name.startswith("model.vision_tower.sam_encoder."):
                value = sam_vision.convert_hf_weight(name, value)
            renamed[rename_prefix(name, HF_PREFIXES)] = value
        deepseek_moe_decoder.split_experts(renamed, "language_model.model.layers.",
                                           self.args.text.moe_intermediate_size)
        return renamed

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        """transformers' DeepseekOcr2Processor over the checkpoint's tokenizer and the PIL
        image processor; the checkpoint's chat template, else ``CHAT_TEMPLATE``."""
        import transformers

        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        image_processor = transformers.DeepseekOcr2ImageProcessorPil.from_pretrained(model_path)
        return transformers.DeepseekOcr2Processor.from_pretrained(
            model_path, tokenizer=tokenizer, image_processor=image_processor,
            chat_template=chat_template or CHAT_TEMPLATE,
        )

    # -- the contract -----------------------------------------------------------------

    def embed(self, input_ids: mx.array, pixel_values: Any = None, pixel_values_local: Any = None,
              num_local_patches: Any = None) -> tuple[mx.array, None]:
        features = None
        if pixel_values is not None:
            features = self.image_features(pixel_values, pixel_values_local, num_local_patches)
        h, _ = merge.embed_with_features(
            self.language_model.model.embed, input_ids, self.args.image_token_id, features,
            "image placeholder tokens",
        )
        return h, None

    def __call__(self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False):
        return self.language_model(input_ids, cache, embeddings, last_only)

    # -- image features ---------------------------------------------------------------

    def view_features(self, pixel_values: Any) -> mx.array:
        """(N, C, H, W) views -> (N, queries, text width); views seen before come from
        the feature cache."""
        pixel_values = mx.array(pixel_values) if not isinstance(pixel_values, mx.array) else pixel_values
        # The compute dtype: a norm's (a linear layer's weight may stay 16-bit on the CPU,
        # see mlxvlm.cpu.half_weights, and may be quantized).
        dtype = self.vision_tower.vision_encoder.norm.weight.dtype

        def encode(views: mx.array) -> mx.array:
            return self.multi_modal_projector(
                self.vision_tower(views.transpose(0, 2, 3, 1).astype(dtype)))

        return cached_rows(self, "deepseek-ocr view", encode, pixel_values)

    def image_features(self, pixel_values, pixel_values_local=None, num_local_patches=None) -> mx.array:
        """Every image's features in prompt order: its tiles', its global view's, the
        separator."""
        global_views = self.view_features(pixel_values)
        counts = [0] * global_views.shape[0]
        if num_local_patches is not None:
            counts = [int(n) for n in np.asarray(num_local_patches).reshape(-1)]
        tiles = self.view_features(pixel_values_local) if sum(counts) else None
        width = global_views.shape[-1]
        separator = self.view_separator.astype(global_views.dtype)[None]
        parts, start = [], 0
        for index, count in enumerate(counts):
            if count:
                parts.append(tiles[start:start + count].reshape(-1, width))
                start += count
            parts.extend([global_views[index], separator])
        return mx.concatenate(parts, axis=0)


def hub_to_transformers_name(name: str) -> str:
    """A Hub checkpoint's original tensor name as transformers 5 names it (unchanged if
    it already is)."""
    for pattern, replacement in HUB_NAMES:
        renamed, count = re.subn(pattern, replacement, name, count=1)
        if count:
            return renamed
    return name


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
