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
boxes), "Parse the figure.", "Describe this image in detail.". Those four markers are
special tokens of its tokenizer: ``answer_markup_tokens`` keeps them in the answer text,
which pairs each label with its box (``<|ref|>title<|/ref|><|det|>[[x1, y1, x2,
y2]]<|/det|>``), as the model card's decoding keeps them.

The prompt's order is the original DeepSeek "plain" conversation's: turns written one
after another, an answer ending with EOS.

Checkpoints: our names are DeepSeek's own without the ``model.`` level, as mlx-community's
conversions (mlx-vlm's) keep them: ``sam_model.blocks.N.norm1``, ``sam_model.neck.0``,
``sam_model.net_2``, ``vision_model.qwen2_encoder.{layers,norm,query_768,query_1024}``,
``projector.layers``, ``view_separator``, ``language_model.model.*`` with mlx-lm's expert
banks (``mlp.switch_mlp``), ``language_model.lm_head``. ``sanitize`` maps the Hub's
originals (``model.sam_model.*``, ``model.qwen2_model.model.model.*``,
``model.view_seperator``, one tensor per expert) and transformers 5's
(``model.vision_tower.sam_encoder.layers.N.layer_norm1``, fused experts) onto them
(``CHECKPOINT_NAMES``). mlx-community's config is DeepSeek's own (``model_type``
"deepseekocr_2": ``language_config``, ``vision_config.width``, ``projector_config``), read
as transformers' (``transformers_layout``).
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
from mlxvlm.models.layers import deepseek_moe_decoder
from mlxvlm.models.layers.sam_vision import SamVisionConfig, SamVisionEncoder
from mlxvlm.models.processor_utils import tokenizer_and_chat_template

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
TILE_SIZE = 768  # DeepSeek's local views, where its own config does not say

# transformers 5's names and the Hub's original ones -> ours (DeepSeek's originals under
# mlx-community's top-level names), first match wins
CHECKPOINT_NAMES = (
    # transformers 5 (save_pretrained)
    (r"^model\.vision_tower\.sam_encoder\.layers\.(\d+)\.layer_norm1\.", r"sam_model.blocks.\1.norm1."),
    (r"^model\.vision_tower\.sam_encoder\.layers\.(\d+)\.layer_norm2\.", r"sam_model.blocks.\1.norm2."),
    (r"^model\.vision_tower\.sam_encoder\.layers\.", "sam_model.blocks."),
    (r"^model\.vision_tower\.sam_encoder\.patch_embed\.projection\.", "sam_model.patch_embed.proj."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.conv1\.", "sam_model.neck.0."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.layer_norm1\.", "sam_model.neck.1."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.conv2\.", "sam_model.neck.2."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.layer_norm2\.", "sam_model.neck.3."),
    (r"^model\.vision_tower\.sam_encoder\.proj\.conv1\.", "sam_model.net_2."),
    (r"^model\.vision_tower\.sam_encoder\.proj\.conv2\.", "sam_model.net_3."),
    (r"^model\.vision_tower\.sam_encoder\.", "sam_model."),
    (r"^model\.vision_tower\.vision_encoder\.", "vision_model.qwen2_encoder."),
    (r"^model\.vision_tower\.query_(768|1024)_resolution\.weight$", r"vision_model.qwen2_encoder.query_\1"),
    (r"^model\.multi_modal_projector\.", "projector.layers."),
    (r"^model\.view_separator$", "view_separator"),
    (r"^model\.language_model\.", "language_model.model."),
    # the Hub's originals
    (r"^model\.sam_model\.", "sam_model."),
    (r"^model\.qwen2_model\.model\.model\.", "vision_model.qwen2_encoder."),
    (r"^model\.qwen2_model\.query_(768|1024)\.weight$", r"vision_model.qwen2_encoder.query_\1"),
    (r"^model\.projector\.", "projector."),
    (r"^model\.view_seperator$", "view_separator"),
    (r"^model\.(embed_tokens|layers|norm)\.", r"language_model.model.\1."),
    (r"^lm_head\.", "language_model.lm_head."),
)
# PyTorch's (out, in, kh, kw) convolutions, moved to MLX's (out, kh, kw, in)
CONVOLUTIONS = ("sam_model.patch_embed.proj.weight", "sam_model.neck.0.weight",
                "sam_model.neck.2.weight", "sam_model.net_2.weight", "sam_model.net_3.weight")
# Our modules' names in transformers' module tree, for PEFT adapters (hf_module_name)
HF_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.multi_modal_projector.", "projector.layers."),
    ("model.vision_tower.sam_encoder.layers.", "sam_model.blocks."),
    ("model.vision_tower.vision_encoder.", "vision_model.qwen2_encoder."),
    ("lm_head.", "language_model.lm_head."),
)
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
        if is_deepseek_layout(config):
            config = transformers_layout(config)
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


def is_deepseek_layout(config: dict) -> bool:
    """DeepSeek's own config (deepseek-ai/DeepSeek-OCR-2, and mlx-community's conversions
    of it, ``model_type`` "deepseekocr_2"): ``language_config``, the towers' sizes under
    ``vision_config.width``, a ``projector_config``."""
    return config.get("model_type") != "deepseek_ocr2" and "projector_config" in config


def transformers_layout(config: dict) -> dict:
    """DeepSeek's own config as transformers' ``deepseek_ocr2`` one. The sizes it leaves
    out are DeepSeek-OCR 2's (the query encoder is Qwen2-0.5B's first 24 layers; SAM's
    last convolution is as wide as the encoder, whatever ``downsample_channels`` says)."""
    text = dict(config.get("language_config") or config.get("text_config") or {})
    if text.get("use_mla") or (text.get("use_mla") is None and text.get("qk_nope_head_dim")):
        raise NotImplementedError("a DeepSeek-OCR 2 text model with latent attention (MLA)")
    if text.get("rope_scaling"):
        raise NotImplementedError("DeepSeek-OCR 2 text RoPE scaling")
    layers = text["num_hidden_layers"]
    first_dense, every = text.get("first_k_dense_replace", 0), text.get("moe_layer_freq", 1)
    sparse = [text.get("n_routed_experts") is not None and i >= first_dense and i % every == 0
              for i in range(layers)]
    text["mlp_layer_types"] = ["sparse" if s else "dense" for s in sparse]
    text["rope_parameters"] = {"rope_type": "default",
                               "rope_theta": float(text.pop("rope_theta", 10000.0))}
    text.pop("model_type", None)
    vision = config["vision_config"]
    sam, qwen = vision["width"]["sam_vit_b"], vision["width"]["qwen2-0-5b"]
    width = qwen.get("dim", 896)
    sam_config = dict(
        hidden_size=sam.get("width", 768), num_hidden_layers=sam.get("layers", 12),
        num_attention_heads=sam.get("heads", 12), image_size=vision.get("image_size", 1024),
        patch_size=sam.get("patch_size", 16), window_size=sam.get("window_size", 14),
        global_attn_indexes=list(sam.get("global_attn_indexes", (2, 5, 8, 11))),
        mlp_dim=int(sam.get("mlp_ratio", 4.0) * sam.get("width", 768)),
        output_channels=sam.get("out_chans", 256),
        downsample_channels=[list(sam.get("downsample_channels", (512,)))[0], width])
    encoder_config = dict(
        hidden_size=width, num_hidden_layers=qwen.get("layers", 24),
        num_attention_heads=qwen.get("heads", 14), num_key_value_heads=qwen.get("kv_heads", 2),
        intermediate_size=qwen.get("intermediate_size", 4864),
        rms_norm_eps=qwen.get("rms_norm_eps", 1e-6), max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": float(qwen.get("rope_theta", 1e6))})
    return {
        "model_type": "deepseek_ocr2",
        "image_token_id": config.get("image_token_id", config.get("image_token_index", 128815)),
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"sam_config": sam_config, "encoder_config": encoder_config},
        **({"quantization": config["quantization"]} if "quantization" in config else {}),
    }


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
    """Qwen2 blocks over a view's map then its learned queries (mlx-lm's ``qwen2``
    blocks); the queries' final states are the view's features."""

    def __init__(self, args: qwen2.ModelArgs):
        super().__init__()
        self.layers = [qwen2.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.query_768 = mx.zeros((TILE_QUERIES, args.hidden_size))
        self.query_1024 = mx.zeros((GLOBAL_QUERIES, args.hidden_size))

    def __call__(self, patches: mx.array) -> mx.array:
        """(N, map tokens, width) -> (N, queries, width)."""
        count = patches.shape[1]
        queries = self.query_768 if count <= TILE_QUERIES else self.query_1024
        queries = mx.broadcast_to(queries[None].astype(patches.dtype),
                                  (patches.shape[0], *queries.shape))
        h = mx.concatenate([patches, queries], axis=1)
        index = mx.arange(h.shape[1])
        # causal, and the map's tokens see the whole map (transformers' block of ids 0)
        mask = (index[None, :] <= index[:, None]) | (
            (index[:, None] < count) & (index[None, :] < count))
        for layer in self.layers:
            h = layer(h, mask)
        return self.norm(h)[:, count:]


class VisionModel(nn.Module):
    def __init__(self, args: qwen2.ModelArgs):
        super().__init__()
        self.qwen2_encoder = QueryEncoder(args)


class Projector(nn.Module):
    def __init__(self, width: int, text_width: int):
        super().__init__()
        self.layers = nn.Linear(width, text_width)

    def __call__(self, x: mx.array) -> mx.array:
        return self.layers(x)


# ------------------------------------------------------------------------------ model


class Model(VisionLanguageModel):
    feature_names = ("pixel_values", "pixel_values_local", "num_local_patches")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    processor_class = "DeepseekOcr2Processor"
    image_processor_class = "DeepseekOcr2ImageProcessorPil"
    answer_markup_tokens = ("<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>")

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.sam_model = SamVisionEncoder(args.sam)
        self.vision_model = VisionModel(args.encoder)
        self.projector = Projector(args.encoder.hidden_size, args.text.hidden_size)
        self.view_separator = mx.zeros((args.text.hidden_size,))
        self.language_model = deepseek_moe_decoder.DeepseekMoeLanguageModel(
            args.text, list(args.mlp_layer_types))

    @property
    def max_context(self) -> int | None:
        return self.args.text.max_position_embeddings

    # -- checkpoint and processor -----------------------------------------------------

    @classmethod
    def is_hf_checkpoint(cls, weight_names) -> bool:
        """transformers 5's names and the Hub's originals all start ``model.`` or
        ``lm_head.``; ours (mlx-community's) never do."""
        return any(name.startswith(("model.", "lm_head.")) for name in weight_names)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        renamed = {}
        for name, value in weights.items():
            if name.endswith(HF_ONLY_SUFFIXES):
                continue
            name = checkpoint_name(name)
            if name in CONVOLUTIONS:
                value = value.transpose(0, 2, 3, 1)
            renamed[name] = value
        deepseek_moe_decoder.split_experts(renamed, "language_model.model.layers.",
                                           self.args.text.moe_intermediate_size)
        return renamed

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        """transformers' DeepseekOcr2Processor over the checkpoint's tokenizer and the PIL
        image processor; the checkpoint's chat template, else ``CHAT_TEMPLATE``. A
        checkpoint in DeepSeek's own layout (mlx-community's conversions) carries no
        transformers processor files: its sizes come from its config and
        processor_config.json (``patch_size``, ``downsample_ratio``)."""
        import transformers

        model_path = Path(model_path)
        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        chat_template = chat_template or CHAT_TEMPLATE
        if config and is_deepseek_layout(config):
            options = _json(model_path / "processor_config.json")
            image_size = config["vision_config"].get("image_size", 1024)
            tile_size = (options.get("image_processor") or {}).get("tile_size", TILE_SIZE)
            image_processor = transformers.DeepseekOcr2ImageProcessorPil(
                size={"height": image_size, "width": image_size}, tile_size=tile_size)
            return transformers.DeepseekOcr2Processor(
                image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template,
                patch_size=options.get("patch_size", 16),
                downsample_ratio=options.get("downsample_ratio", 4))
        image_processor = transformers.DeepseekOcr2ImageProcessorPil.from_pretrained(model_path)
        return transformers.DeepseekOcr2Processor.from_pretrained(
            model_path, tokenizer=tokenizer, image_processor=image_processor,
            chat_template=chat_template,
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
        dtype = self.vision_model.qwen2_encoder.norm.weight.dtype

        def encode(views: mx.array) -> mx.array:
            # One view at a time: a global SAM block's scores and relative-position bias
            # are heads x tokens^2 per view (12 x 4096^2 for a 1024-px view), which a
            # batch of a page's tiles would multiply.
            features = []
            for view in views:
                patches = self.sam_model(view[None].transpose(0, 2, 3, 1).astype(dtype))
                features.append(self.projector(self.vision_model.qwen2_encoder(patches)))
                mx.eval(features[-1])
            return mx.concatenate(features)

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


def checkpoint_name(name: str) -> str:
    """A Hugging Face checkpoint's tensor name (transformers 5's or the Hub's original)
    as ours."""
    for pattern, replacement in CHECKPOINT_NAMES:
        renamed, count = re.subn(pattern, replacement, name, count=1)
        if count:
            return renamed
    return name


def _json(path: Path) -> dict:
    import json

    return json.loads(path.read_text()) if path.exists() else {}


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
