"""Phi-4-multimodal (Microsoft, 2025), in transformers' native layout
(``model_type: phi4_multimodal``): a SigLIP tower over 448-px crops, a conformer audio
encoder, and the Phi-4-mini text model (Phi-3's blocks: fused q/k/v and gate/up, partial
rotary under LongRoPE).

Images (the HD transform, ``phi4_multimodal_images``): the tower encodes a global view
and the picture's crops; the hidden states of ``feature_layer`` are 2 x 2 average-pooled
to 16 x 16 tokens per crop. The crops' tokens are laid out as the picture (rows of crops,
the padding's tokens cut off by the crops' patch masks), each token row closed by a
learned separator (``sub_img_feature_extensor``); then one learned token
(``global_img_feature_extensor``) and the global view's rows with their separators. The
whole run goes through a GELU MLP (``img_projection_up`` / ``_down``).

Audio (``layers/phi4mm_audio.py``, features from ``phi4_multimodal_audio_features``):
the encoder's states through one of two GELU MLPs -- the speech projection, or the
vision-speech one when the prompt also carries an image, as transformers chooses -- and
the first ``audio_embed_sizes`` of each clip.

Checkpoint names: transformers' module tree (``model.layers.*``, ``model.embed_tokens``,
``model.embed_tokens_extend.image_embed.*`` / ``.audio_embed.*``, ``lm_head``) as
``language_model.model.*``, ``image_embed.*``, ``audio_embed.*``,
``language_model.lm_head``. The release's LoRA adapters for vision and speech are PEFT
folders beside the base weights (``vision-lora``, ``speech-lora``), not merged into them:
one applies with ``load(..., adapter_path=<checkpoint>/vision-lora)`` (``--adapter-path``)
as transformers' ``load_adapter`` + ``set_adapter`` apply it, for every request of that
model (they are not switched per request by its media).

``embed``'s state is the prompt's ``RopeRegime``: whether it is longer than the original
context, in which case every position is on LongRoPE's long factors however the prompt
is chunked (``layers/longrope.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import phi3
from mlx_lm.models.base import create_attention_mask

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it
from mlxvlm.models.feature_cache import cached_rows
from mlxvlm.models.layers import phi4mm_audio, siglip
from mlxvlm.models.layers.blocks import TextDecoder
from mlxvlm.models.layers.longrope import LongRoPE, attention_factor, long_rows
from mlxvlm.models.processor_utils import tokenizer_and_chat_template
from mlxvlm.models.weights import map_hf_weights

IMAGE = "image_embed."
AUDIO = "audio_embed."
HF_PREFIXES = (
    ("model.embed_tokens_extend.image_embed.", IMAGE),
    ("model.embed_tokens_extend.audio_embed.", AUDIO),
    ("model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)
MLX_PREFIXES = ("language_model.", IMAGE, AUDIO)
VISION_TOWER = IMAGE + "img_processor."
AUDIO_TOWER = AUDIO + "encoder."
LM_HEAD = "language_model.lm_head.weight"


# ----------------------------------------------------------------------------- config


def text_args(config: dict) -> phi3.ModelArgs:
    """mlx-lm's phi3 arguments from the config as transformers reads it (LongRoPE is
    built here, not by mlx-lm: ``rope_scaling`` stays None)."""
    rope = config["rope_parameters"]
    if rope.get("rope_type", "default") not in ("default", "longrope"):
        raise NotImplementedError(f"Phi-4-multimodal with rope {rope['rope_type']!r}")
    if config.get("sliding_window") is not None:
        raise NotImplementedError("Phi-4-multimodal with a sliding window is not supported")
    return phi3.ModelArgs(
        model_type="phi3", hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"], rms_norm_eps=config["rms_norm_eps"],
        vocab_size=config["vocab_size"], rope_theta=float(rope["rope_theta"]),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        max_position_embeddings=config["max_position_embeddings"],
        original_max_position_embeddings=rope.get(
            "original_max_position_embeddings", config.get("original_max_position_embeddings") or 4096),
        tie_word_embeddings=bool(config["tie_word_embeddings"]),
    )


@dataclass(frozen=True)
class ModelArgs:
    text: phi3.ModelArgs
    rope: dict  # transformers' standardized rope_parameters
    vision: siglip.SiglipVisionConfig
    audio: phi4mm_audio.AudioConfig
    vision_feature_layer: int
    crop_size: int
    image_token_id: int
    audio_token_id: int

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        config = as_transformers_reads_it(config)
        vision = config["vision_config"]
        audio = config["audio_config"]
        return cls(
            # (the Hub's rope_scaling keeps its old "type" beside the standardized keys)
            text=text_args(config),
            rope={k: v for k, v in config["rope_parameters"].items() if k != "type"},
            vision=siglip.SiglipVisionConfig.from_hf(vision),
            audio=phi4mm_audio.AudioConfig.from_hf(audio),
            vision_feature_layer=vision["feature_layer"], crop_size=vision["crop_size"],
            image_token_id=vision["image_token_id"], audio_token_id=audio["audio_token_id"],
        )


# ----------------------------------------------------------------------------- decoder


@dataclass(frozen=True)
class RopeRegime:
    """Per row, whether the sequence is on LongRoPE's long factors from its first token:
    its prompt is longer than the original context, which transformers computes in one
    pass on the long factors (see ``layers/longrope.py``)."""

    long: np.ndarray  # (rows,) bool

    @staticmethod
    def batch(states) -> "RopeRegime":
        return RopeRegime(np.concatenate(
            [s.long if s is not None else np.zeros(1, bool) for s in states]))

    def prefix(self, length: int) -> "RopeRegime":
        # A longer prompt over a cached prefix: the prefix's keys keep its regime.
        return self


class TextModel(TextDecoder):
    """Phi-4-mini: mlx-lm's phi3 blocks, each attention's rotary LongRoPE as transformers
    applies it."""

    def __init__(self, args: ModelArgs):
        text = args.text
        layers = [phi3.TransformerBlock(text) for _ in range(text.num_hidden_layers)]
        super().__init__(text.vocab_size, text.hidden_size, layers,
                         nn.RMSNorm(text.hidden_size, eps=text.rms_norm_eps))
        if args.rope.get("rope_type") == "longrope":
            head_dim = text.hidden_size // text.num_attention_heads
            dims = int(head_dim * text.partial_rotary_factor)
            rope = dict(args.rope)
            rope.setdefault("original_max_position_embeddings", text.original_max_position_embeddings)
            for layer in layers:
                layer.self_attn.rope = LongRoPE(
                    dims, text.rope_theta, rope["short_factor"], rope["long_factor"],
                    rope["original_max_position_embeddings"],
                    attention_factor(rope, text.max_position_embeddings))

    def __call__(self, h: mx.array, cache: list[Any]) -> mx.array:
        mask = create_attention_mask(h, cache[0])
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, mask, layer_cache)
        return self.norm(h)


class LanguageModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.model = TextModel(args)
        if not args.text.tie_word_embeddings:
            self.lm_head = nn.Linear(args.text.hidden_size, args.text.vocab_size, bias=False)

    def head(self, h: mx.array) -> mx.array:
        return self.lm_head(h) if "lm_head" in self else self.model.embed_tokens.as_linear(h)


# ----------------------------------------------------------------------------- towers


class ImageEmbedding(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        width, text_width = args.vision.hidden_size, args.text.hidden_size
        if args.vision.patches_per_side % 2:
            raise NotImplementedError("Phi-4-multimodal with an odd patch grid is not supported")
        self.img_processor = siglip.SiglipVisionTransformer(args.vision)
        self.img_projection_up = nn.Linear(width, text_width)
        self.img_projection_down = nn.Linear(text_width, text_width)
        self.global_img_feature_extensor = mx.zeros((1, 1, width))
        self.sub_img_feature_extensor = mx.zeros((1, 1, 1, width))


class AudioEmbedding(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        audio_width = args.audio.hidden_size * args.audio.downsample_rate
        text_width = args.text.hidden_size
        self.encoder = phi4mm_audio.AudioEncoder(args.audio)
        self.up_proj_for_speech = nn.Linear(audio_width, text_width)
        self.down_proj_for_speech = nn.Linear(text_width, text_width)
        self.up_proj_for_vision_speech = nn.Linear(audio_width, text_width)
        self.down_proj_for_vision_speech = nn.Linear(text_width, text_width)

    def project(self, states: mx.array, with_image: bool) -> mx.array:
        if with_image:
            return self.down_proj_for_vision_speech(nn.gelu(self.up_proj_for_vision_speech(states)))
        return self.down_proj_for_speech(nn.gelu(self.up_proj_for_speech(states)))


# ----------------------------------------------------------------------------- the model


class Model(VisionLanguageModel):
    feature_names = ("image_pixel_values", "image_sizes", "image_attention_mask",
                     "audio_input_features", "audio_embed_sizes", "audio_attention_mask")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    mlx_prefixes = MLX_PREFIXES
    processor_class = "Phi4MultimodalProcessor"

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.language_model = LanguageModel(args)
        self.image_embed = ImageEmbedding(args)
        self.audio_embed = AudioEmbedding(args)

    # -- checkpoint and processor -----------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return map_hf_weights(
            weights, self.hf_to_mlx_name,
            towers={VISION_TOWER: siglip.convert_hf_weight, AUDIO_TOWER: phi4mm_audio.convert_hf_weight},
            drop={LM_HEAD} if self.args.text.tie_word_embeddings else (),
        )

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        """transformers' Phi4MultimodalProcessor over mlxvlm's numpy image processor and
        feature extractor (transformers computes both with torch only)."""
        from transformers import Phi4MultimodalProcessor

        from mlxvlm.models.phi4_multimodal_audio_features import Phi4MultimodalFeatureExtractorNumpy
        from mlxvlm.models.phi4_multimodal_images import Phi4MultimodalImageProcessorPil

        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        missing = [name for name in ("image_token", "audio_token")
                   if getattr(tokenizer, name, None) is None]
        if missing:
            raise ValueError(
                f"the checkpoint's tokenizer names no {' or '.join(missing)} (Phi-4-multimodal's "
                "processor needs them: transformers' layout lists them in tokenizer_config.json "
                "under extra_special_tokens)"
            )
        return Phi4MultimodalProcessor(
            image_processor=Phi4MultimodalImageProcessorPil.from_pretrained(model_path),
            audio_processor=Phi4MultimodalFeatureExtractorNumpy.from_pretrained(model_path),
            tokenizer=tokenizer, chat_template=chat_template,
        )

    # -- the decoder ------------------------------------------------------------------

    def __call__(self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False):
        decoder = self.language_model.model
        h, cache = decoder.start(input_ids, cache, embeddings)
        with long_rows(state.long if state is not None else None):
            h = decoder(h, cache)
        return self.language_model.head(h[:, -1:] if last_only else h)

    def rope_regime(self, length: int) -> RopeRegime:
        original = self.args.rope.get("original_max_position_embeddings",
                                      self.args.text.original_max_position_embeddings)
        long = self.args.rope.get("rope_type") == "longrope" and length > original
        return RopeRegime(np.array([long]))

    # -- embeddings -------------------------------------------------------------------

    def embed(self, input_ids: mx.array, image_pixel_values: Any = None, image_sizes: Any = None,
              image_attention_mask: Any = None, audio_input_features: Any = None,
              audio_embed_sizes: Any = None, audio_attention_mask: Any = None):
        if input_ids.shape[0] != 1:
            raise ValueError("Phi-4-multimodal embeds one prompt at a time")
        ids = np.asarray(input_ids).reshape(-1)
        h = self.language_model.model.embed(input_ids)
        images = None
        if image_pixel_values is not None:
            images = self.image_features(image_pixel_values, image_sizes, image_attention_mask)
        h = merge.merge_features(h, merge.placeholder_positions(ids, self.args.image_token_id),
                                 images, "image placeholder tokens")
        sounds = None
        if audio_input_features is not None:
            sounds = self.audio_features(audio_input_features, audio_embed_sizes,
                                         audio_attention_mask, with_image=images is not None)
        h = merge.merge_features(h, merge.placeholder_positions(ids, self.args.audio_token_id),
                                 sounds, "audio placeholder tokens", "the audio encoder")
        return h, self.rope_regime(len(ids))

    def crop_features(self, crops: mx.array, masks: np.ndarray) -> mx.array:
        """(crops, C, H, W) with their (crops, h, w) patch masks -> (crops, 16 * 16,
        width): the tower's ``feature_layer`` states, 2 x 2 average-pooled."""
        tower = self.image_embed.img_processor
        dtype = self.image_embed.img_projection_up.weight.dtype
        _, states = tower(crops.transpose(0, 2, 3, 1).astype(dtype), masks.astype(bool),
                          output_hidden_states=True)
        h = states[self.args.vision_feature_layer]
        n, tokens, width = h.shape
        side = math.isqrt(tokens)
        pooled = h.reshape(n, side // 2, 2, side // 2, 2, width).mean(axis=(2, 4))
        return pooled.reshape(n, -1, width)

    def image_features(self, pixel_values: Any, image_sizes: Any, attention_mask: Any) -> mx.array:
        """All images' placeholder features, in prompt order."""
        sizes = np.asarray(image_sizes).reshape(-1, 2)
        pixels = np.asarray(pixel_values)
        masks = np.asarray(attention_mask) if attention_mask is not None else \
            np.ones((*pixels.shape[:2], *(s // self.args.vision.patch_size for s in pixels.shape[-2:])))
        crop = self.args.crop_size
        outputs = []
        for index, (height, width) in enumerate(sizes.tolist()):
            rows, columns = height // crop, width // crop
            count = 1 + rows * columns  # the global view, then the crops (no batch padding)
            # The tower sees each crop on its own: crops seen before come from the cache.
            features = cached_rows(
                self, "phi4mm crop", lambda p, m: self.crop_features(mx.array(p), np.asarray(m)),
                pixels[index, :count], masks[index, :count])
            outputs.append(self.assemble_image(features, masks[index, 1:count], rows, columns))
        return mx.concatenate(outputs, axis=0)

    def assemble_image(self, features: mx.array, crop_masks: np.ndarray, rows: int,
                       columns: int) -> mx.array:
        """One picture's (1 + crops, side * side, width) features -> its projected
        placeholder run: crops as the picture (padding cut), then the global view."""
        embed = self.image_embed
        side = math.isqrt(features.shape[1])
        width = features.shape[-1]
        separator = embed.sub_img_feature_extensor.reshape(1, 1, width).astype(features.dtype)

        def with_separators(grid: mx.array) -> mx.array:
            column = mx.broadcast_to(separator, (grid.shape[0], 1, width))
            return mx.concatenate([grid, column], axis=1).reshape(-1, width)

        glob = with_separators(features[0].reshape(side, side, width))
        sub = features[1:].reshape(rows, columns, side, side, width).transpose(0, 2, 1, 3, 4)
        sub = sub.reshape(rows * side, columns * side, width)
        kept = crop_masks[:, 0::2, 0::2].reshape(rows, columns, side, side).transpose(0, 2, 1, 3)
        kept = kept.reshape(rows * side, columns * side)
        useful_height, useful_width = int(kept[:, 0].sum()), int(kept[0, :].sum())
        sub = with_separators(sub[:useful_height, :useful_width])
        joined = mx.concatenate(
            [sub, embed.global_img_feature_extensor.reshape(1, width).astype(features.dtype), glob], axis=0)
        return embed.img_projection_down(nn.gelu(embed.img_projection_up(joined)))

    def audio_features(self, features: Any, sizes: Any, attention_mask: Any,
                       with_image: bool) -> mx.array:
        """All clips' placeholder features, in prompt order: each clip's encoder states
        (padded clips as transformers pads them) projected, its first ``sizes`` kept."""
        feats = np.asarray(features, dtype=np.float32)
        masks = np.ones(feats.shape[:2], dtype=bool) if attention_mask is None else \
            np.asarray(attention_mask).astype(bool)
        dtype = self.audio_embed.up_proj_for_speech.weight.dtype

        def encode(f, m):
            # Without the processor's mask (one clip) transformers masks no padding, not
            # even the fold's past 500 steps: the same here.
            m = None if attention_mask is None else np.asarray(m)
            states = self.audio_embed.encoder(mx.array(f).astype(dtype), m)
            return self.audio_embed.project(states, with_image)

        kind = "phi4mm audio+image" if with_image else "phi4mm audio"
        states = cached_rows(self, kind, encode, feats, masks)
        counts = np.asarray(sizes).reshape(-1).tolist()
        return mx.concatenate([states[i, :n] for i, n in enumerate(counts)], axis=0)


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
