"""Gemma 4 (Google DeepMind, 2026): a vision encoder whose patch windows are pooled into
soft tokens (``layers/gemma4_vision.py``), each modality's tokens RMS-normed (no scale)
and projected into the Gemma 4 text model, whose layers mix sliding-window and global
attention. What the config sets, the text model does: per-layer inputs (PLE) and KV
sharing across the last layers (the E2B/E4B "effective" models), double-wide MLPs in the
KV-sharing layers, a mixture of experts beside the dense MLP (26B-A4B), global layers
with their own head size, KV heads and keys doubling as values, proportional rope, and
final-logit soft-capping.

mlx-lm's ``gemma4_text`` supplies the blocks, the per-layer-input helpers and the KV
sharing plan. The decoder loop is written here for what transformers does differently
around them: soft tokens enter unscaled (text embeddings are scaled by
sqrt(hidden_size)), the per-layer inputs of a placeholder are the pad token's, and with
``use_bidirectional_attention: "vision"`` an image's tokens attend to each other both
ways in the sliding layers (not in the global ones).

Checkpoint names (as mlx-community publishes them): ``vision_tower.*``,
``embed_vision.*``, ``language_model.model.*`` and, only when the head is not tied,
``language_model.lm_head``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import gemma4_text

from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it, decoder_sizes
from mlxvlm.models.gemma3 import ImageBlocks, attention_mask
from mlxvlm.models.layers import gemma4_audio, gemma4_vision
from mlxvlm.models import gemma3n
from mlxvlm.models.merge import merge_features, placeholder_positions
from mlxvlm.models.processor_utils import image_only, tokenizer_and_chat_template
from mlxvlm.models.weights import map_hf_weights

# Hugging Face name prefix -> ours: Gemma 3n's module tree, which Gemma 4 keeps.
HF_PREFIXES = gemma3n.HF_PREFIXES
LM_HEAD = "language_model.lm_head.weight"
# Buffers transformers keeps that are recomputed here.
SKIPPED_SUFFIXES = ("inv_freq", "embed_scale")


# ----------------------------------------------------------------------------- config


def text_args(text: dict) -> gemma4_text.ModelArgs:
    """mlx-lm's Gemma 4 arguments from the text config as transformers reads it, checked
    against what mlx-lm's blocks implement."""
    layer_types = text["layer_types"]
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    per_layer = {int(k): v for k, v in (text.get("per_layer_config") or {}).items()}
    overrides = per_layer.get(full[0], {}) if full else {}
    global_head_dim = overrides.get("head_dim", text["head_dim"])
    global_kv_heads = overrides.get("num_key_value_heads")
    unsupported = {
        "per-layer settings other than the global layers' head size and KV heads": (
            set(per_layer) - set(full)
            or any(per_layer.get(i, {}) != overrides for i in full)
            or set(overrides) - {"head_dim", "num_key_value_heads"}
        ),
        "KV heads of their own in global layers without attention_k_eq_v": (
            global_kv_heads is not None and not text.get("attention_k_eq_v")
        ),
        f"use_bidirectional_attention {text.get('use_bidirectional_attention')!r}": (
            text.get("use_bidirectional_attention") not in (None, "vision")
        ),
        "attention_bias": bool(text.get("attention_bias")),
        f"hidden_activation {text['hidden_activation']!r}": (
            text["hidden_activation"] != "gelu_pytorch_tanh"
        ),
        "a sliding rope other than the default": (
            text["rope_parameters"]["sliding_attention"].get("rope_type") != "default"
        ),
    }
    for what, present in unsupported.items():
        if present:
            raise NotImplementedError(f"Gemma 4 with {what} is not supported")
    return gemma4_text.ModelArgs(
        **decoder_sizes(text),
        global_head_dim=global_head_dim,
        vocab_size_per_layer_input=text["vocab_size_per_layer_input"],
        num_global_key_value_heads=global_kv_heads,
        num_kv_shared_layers=text["num_kv_shared_layers"],
        pad_token_id=text["pad_token_id"],
        hidden_size_per_layer_input=text["hidden_size_per_layer_input"] or 0,
        rope_parameters=text["rope_parameters"],
        sliding_window=text["sliding_window"],
        max_position_embeddings=text["max_position_embeddings"],
        attention_k_eq_v=bool(text["attention_k_eq_v"]),
        final_logit_softcapping=text["final_logit_softcapping"],
        use_double_wide_mlp=bool(text["use_double_wide_mlp"]),
        enable_moe_block=bool(text["enable_moe_block"]),
        num_experts=text["num_experts"],
        top_k_experts=text["top_k_experts"],
        moe_intermediate_size=text["moe_intermediate_size"],
        layer_types=list(layer_types),
        tie_word_embeddings=bool(text["tie_word_embeddings"]),
    )


@dataclass
class ModelArgs:
    text: gemma4_text.ModelArgs
    vision: gemma4_vision.VisionConfig | None
    audio: gemma4_audio.AudioConfig | None
    image_token_id: int
    video_token_id: int
    audio_token_id: int
    # an image's (a video frame's) tokens see each other in the sliding layers
    bidirectional_vision: bool

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        """From either config layout, read through transformers' config classes (the
        Hub's names the global layers' head size ``global_head_dim``, transformers
        5.24's ``per_layer_config``)."""
        config = as_transformers_reads_it(config)
        text = dict(config["text_config"])
        text["tie_word_embeddings"] = config.get("tie_word_embeddings", text["tie_word_embeddings"])
        vision, audio = config.get("vision_config"), config.get("audio_config")
        return cls(
            text=text_args(text),
            vision=gemma4_vision.VisionConfig.from_hf(vision) if vision else None,
            audio=gemma4_audio.AudioConfig.from_hf(audio) if audio else None,
            image_token_id=config["image_token_id"],
            video_token_id=config["video_token_id"],
            audio_token_id=config["audio_token_id"],
            bidirectional_vision=text.get("use_bidirectional_attention") == "vision",
        )


# ------------------------------------------------------------------------- embedders


def channels_last(name: str, value: mx.array) -> mx.array:
    """The audio tower's PyTorch convolutions, (out, in, k...), as MLX's (out, k..., in)."""
    if name.endswith(".conv.weight") and value.ndim == 4:
        return value.transpose(0, 2, 3, 1)
    if name.endswith("depthwise_conv1d.weight") and value.ndim == 3:
        return value.transpose(0, 2, 1)
    return value


class MultimodalEmbedder(nn.Module):
    """A tower's tokens into the text width: RMS norm without scale, then a projection."""

    def __init__(self, width: int, text_width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(width, text_width, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(mx.fast.rms_norm(x, None, self.eps))


# -------------------------------------------------------------------------- decoder


@dataclass
class PromptState:
    """Which prompt tokens form one image (a video frame): their block ids (``blocks``,
    as Gemma 3's), used only where the config makes them attend both ways."""

    blocks: ImageBlocks | None

    @property
    def spans(self) -> list[tuple[int, int]]:
        return self.blocks.spans if self.blocks is not None else []

    @staticmethod
    def batch(states) -> None:
        return None  # generated tokens are text

    def prefix(self, length: int) -> "PromptState":
        return PromptState(self.blocks.prefix(length) if self.blocks is not None else None)


def run_decoder(text: gemma4_text.Gemma4TextModel, h: mx.array, ple_ids: mx.array,
                cache: list[Any], blocks: np.ndarray | None) -> mx.array:
    """mlx-lm's Gemma 4 layers over ``h`` (embeddings already scaled and merged), with
    the per-layer inputs of ``ple_ids`` and, in the sliding layers, ``blocks`` (block ids
    of an image's tokens) opened up both ways. Layers past the cache's length share the
    KV of an earlier layer (mlx-lm's ``previous_kvs``)."""
    per_layer = None
    if text.hidden_size_per_layer_input:
        per_layer = text._project_per_layer_inputs(h, text._get_per_layer_inputs(ple_ids))
    cache = list(cache) + [None] * (len(text.layers) - len(cache))
    masks = {}
    for layer, c in zip(text.layers, cache):
        if layer.layer_type not in masks:
            sliding = layer.layer_type == "sliding_attention"
            masks[layer.layer_type] = attention_mask(
                h, c, text.window_size if sliding else None, blocks if sliding else None
            )
    shared = [(None, None)] * len(text.layers)
    for i, (layer, c) in enumerate(zip(text.layers, cache)):
        source = text.previous_kvs[i]
        kvs, offset = shared[source]
        if source != i and kvs is not None and isinstance(kvs[0], (tuple, list)):
            # a quantized cache (--kv-bits) hands out its packed keys and values; the
            # layers that borrow them attend without a cache, over plain arrays
            q = cache[source]
            kvs = tuple(mx.dequantize(*t, group_size=q.group_size, bits=q.bits) for t in kvs)
            shared[source] = (kvs, offset)
        h, kvs, offset = layer(
            h, masks[layer.layer_type], c,
            per_layer_input=None if per_layer is None else per_layer[:, :, i, :],
            shared_kv=kvs, offset=offset,
        )
        shared[i] = (kvs, offset)
    return text.norm(h)


# ---------------------------------------------------------------------------- model


class Model(VisionLanguageModel):
    feature_names = ("pixel_values", "image_position_ids", "pixel_values_videos",
                     "video_position_ids", "input_features", "input_features_mask")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    # The per-layer embeddings (E2B: 262,144 x 35 layers x 256): one row per token.
    gathered_tables = ("language_model.model.embed_tokens_per_layer",)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        text = args.text
        if args.vision is not None:
            self.vision_tower = gemma4_vision.VisionModel(args.vision)
            self.embed_vision = MultimodalEmbedder(
                args.vision.hidden_size, text.hidden_size, args.vision.rms_norm_eps
            )
        if args.audio is not None:
            self.audio_tower = gemma4_audio.AudioModel(args.audio)
            self.embed_audio = MultimodalEmbedder(
                args.audio.output_proj_dims, text.hidden_size, args.audio.rms_norm_eps
            )
        self.language_model = gemma4_text.Model(text)

    # -- checkpoints and processors ---------------------------------------------------

    @classmethod
    def load_processor(cls, model_path, config: dict):
        """transformers' Gemma 4 processor (tokenizer, PIL image processor, audio feature
        extractor, chat template) with mlxvlm's numpy video processor."""
        from transformers import (
            Gemma4AudioFeatureExtractor,
            Gemma4ImageProcessorPil,
            Gemma4Processor,
        )

        from mlxvlm.models.gemma4_video import Gemma4VideoProcessor

        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        return image_only(Gemma4Processor)(
            image_processor=Gemma4ImageProcessorPil.from_pretrained(model_path),
            feature_extractor=Gemma4AudioFeatureExtractor.from_pretrained(model_path),
            video_processor=Gemma4VideoProcessor.from_pretrained(model_path),
            tokenizer=tokenizer,
            chat_template=chat_template,
        )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """transformers' names onto ours; the tied head, the KV-sharing layers' unused
        projections and unused clipping bounds left out, experts split as mlx-lm's."""
        sanitized = map_hf_weights(
            weights, self.hf_to_mlx_name, skip_suffixes=SKIPPED_SUFFIXES,
            drop={LM_HEAD} if self.args.text.tie_word_embeddings else (),
        )
        vision, audio = self.args.vision, self.args.audio
        clipped = tuple(
            tower for tower, config in (("vision_tower.", vision), ("audio_tower.", audio))
            if config is not None and config.use_clipped_linears
        )
        text_weights = {}
        others = {}
        for name, value in sanitized.items():
            if name.startswith("language_model."):
                text_weights[name[len("language_model."):]] = value
            elif name.endswith(("input_min", "input_max", "output_min", "output_max")):
                if name.startswith(clipped):
                    others[name] = value
            elif name.startswith("audio_tower."):
                others[name] = channels_last(name, value)
            else:
                others[name] = value
        text_weights = self.language_model.sanitize(text_weights)
        return {**others, **{f"language_model.{k}": v for k, v in text_weights.items()}}

    # -- the contract -----------------------------------------------------------------

    def make_cache(self) -> list[Any]:
        return self.language_model.make_cache()

    def bidirectional_spans(self, state: PromptState | None) -> list[tuple[int, int]]:
        return state.spans if state is not None else []

    def _multimodal_mask(self, ids: np.ndarray) -> np.ndarray:
        a = self.args
        return np.isin(ids, [a.image_token_id, a.video_token_id, a.audio_token_id])

    def _embed_tokens(self, input_ids: mx.array) -> mx.array:
        """Token embeddings times sqrt(hidden_size), held in the compute dtype as
        transformers holds it."""
        text = self.language_model.model
        h = text.embed_tokens(input_ids)
        return h * mx.array(text.embed_scale, dtype=h.dtype)

    def _text_ids(self, input_ids: mx.array) -> mx.array:
        """The ids with every placeholder replaced by the pad token (whose per-layer
        input a placeholder takes, as in transformers)."""
        ids = np.asarray(input_ids)
        return mx.array(np.where(self._multimodal_mask(ids), self.args.text.pad_token_id, ids))

    def embed(self, input_ids: mx.array, pixel_values: Any = None,
              image_position_ids: Any = None, pixel_values_videos: Any = None,
              video_position_ids: Any = None, input_features: Any = None,
              input_features_mask: Any = None) -> tuple[mx.array, PromptState]:
        ids = np.asarray(input_ids).reshape(-1)
        h = self._embed_tokens(self._text_ids(input_ids))
        features = None
        if pixel_values is not None:
            features = self.image_features(pixel_values, image_position_ids)
        h = merge_features(h, placeholder_positions(ids, self.args.image_token_id), features)
        frames = None
        if pixel_values_videos is not None:  # every frame a picture of its own
            frames = self.image_features(pixel_values_videos, video_position_ids)
        h = merge_features(h, placeholder_positions(ids, self.args.video_token_id), frames,
                           "video tokens")
        sound = None
        if input_features is not None:
            sound = self.audio_features(input_features, input_features_mask)
        h = merge_features(h, placeholder_positions(ids, self.args.audio_token_id), sound,
                           "audio tokens", "the audio tower")
        blocks = None
        if self.args.bidirectional_vision:
            vision = np.isin(ids, [self.args.image_token_id, self.args.video_token_id])
            blocks = ImageBlocks.from_input_ids(vision.astype(np.int64), 1)
        return h, PromptState(blocks)

    def image_features(self, pixel_values: Any, positions: Any) -> mx.array:
        """(soft tokens of every image, text width) from the processor's patches."""
        dtype = self.embed_vision.embedding_projection.weight.dtype
        tokens = self.vision_tower(mx.array(pixel_values).astype(dtype), np.asarray(positions))
        return self.embed_vision(tokens)

    def audio_features(self, input_features: Any, mask: Any) -> mx.array:
        """(soft tokens of every clip's real frames, text width) from the extractor's output."""
        dtype = self.embed_audio.embedding_projection.weight.dtype
        tokens = self.audio_tower(mx.array(input_features).astype(dtype), mx.array(mask))
        return self.embed_audio(tokens)

    def _head(self, h: mx.array) -> mx.array:
        lm = self.language_model
        logits = lm.lm_head(h) if "lm_head" in lm else lm.model.embed_tokens.as_linear(h)
        if lm.final_logit_softcapping is not None:
            logits = gemma4_text.logit_softcap(lm.final_logit_softcapping, logits)
        return logits

    def __call__(self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False):
        h = embeddings if embeddings is not None else self._embed_tokens(self._text_ids(input_ids))
        if cache is None:
            cache = []
        offset = cache[0].offset if cache and cache[0] is not None else 0
        blocks = None
        if state is not None and state.blocks is not None:
            blocks = state.blocks.chunk(offset, h.shape[1])
        h = run_decoder(self.language_model.model, h, self._text_ids(input_ids), cache, blocks)
        return self._head(h[:, -1:] if last_only else h)


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
