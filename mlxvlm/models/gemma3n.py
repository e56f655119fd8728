"""Gemma 3n (Gemma Team, 2025): Google's on-device model. A MobileNetV5 vision tower
(``layers/mobilenet_v5.py``) whose fused 2048-wide feature map becomes soft tokens, each
embedded into the text width by a multimodal embedder (RMS norm, projection, RMS norm);
the text model is mlx-lm's ``gemma3n`` backbone (AltUp, Laurel, per-layer inputs, sliding
and global layers, the last layers reading the KV of earlier ones, MatFormer widths,
soft-capped logits), fed through its input-embeddings path.

Gemma 3n's vocabulary holds the text tokens, then the vision tokens, then the audio ones;
the vision and audio tokens are embedded by their embedders (``embed_vision``,
``embed_audio``), and their per-layer inputs are those of token 0. Image tokens attend
causally, like text.

Checkpoint names (as mlx-community publishes them): ``language_model.model.*``,
``vision_tower.timm_model.*``, ``embed_vision.*``, ``audio_tower.*``, ``embed_audio.*``;
the head is tied to the token embeddings. The audio tower (``layers/gemma3n_audio.py``)
gives each clip at most ``audio_soft_tokens_per_image`` soft tokens, padded to that many
with the embedding of the last audio token, as transformers pads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3n as mlx_gemma3n

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.feature_cache import cached_rows
from mlxvlm.models.layers import gemma3n_audio, mobilenet_v5
from mlxvlm.models.weights import map_hf_weights

# Hugging Face name prefix -> ours: transformers' module tree (``model.*``, ``lm_head``),
# also what transformers 5 saves; Gemma 4 keeps the same tree.
HF_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.embed_vision.", "embed_vision."),
    ("model.audio_tower.", "audio_tower."),
    ("model.embed_audio.", "embed_audio."),
    ("lm_head.", "language_model.lm_head."),
)
MLX_PREFIXES = ("language_model.", "vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")
VISION_TOWER = "vision_tower.timm_model."
AUDIO_TOWER = "audio_tower."
# The projections KV-sharing layers do not have (older checkpoints store them unused).
SHARED_KV_MODULES = ("k_proj", "v_proj", "k_norm", "v_norm")


# ----------------------------------------------------------------------------- config


def text_args(config: dict) -> mlx_gemma3n.TextConfig:
    """mlx-lm's text config from the ``text_config`` as transformers reads it (defaults,
    and the Hub's ``rope_theta`` / ``rope_local_base_freq`` as ``rope_parameters``)."""
    from transformers import Gemma3nTextConfig

    raw = {k: v for k, v in config["text_config"].items() if k not in ("model_type", "architectures")}
    text = Gemma3nTextConfig(**raw).to_dict()
    rope = text["rope_parameters"]
    for layer_type, params in rope.items():
        if params.get("rope_type", "default") != "default":
            raise NotImplementedError(f"Gemma 3n with {layer_type} rope {params['rope_type']!r}")
    unsupported = {
        "attention_bias": bool(text.get("attention_bias")),
        f"hidden_activation {text['hidden_activation']!r}": text["hidden_activation"] != "gelu_pytorch_tanh",
        "altup_active_idx other than 0": text["altup_active_idx"] != 0,
    }
    for what, present in unsupported.items():
        if present:
            raise NotImplementedError(f"Gemma 3n with {what} is not supported")
    # Fields mlx-lm names as transformers does, taken as they are.
    same = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "rms_norm_eps", "vocab_size", "num_key_value_heads", "num_kv_shared_layers",
            "vocab_size_per_layer_input", "sliding_window", "max_position_embeddings",
            "final_logit_softcapping", "hidden_size_per_layer_input", "altup_num_inputs",
            "altup_coef_clip", "altup_correct_scale", "altup_active_idx", "laurel_rank")
    return mlx_gemma3n.TextConfig(
        model_type="gemma3n_text",
        intermediate_size=list(text["intermediate_size"]),
        rope_local_base_freq=float(rope["sliding_attention"]["rope_theta"]),
        rope_theta=float(rope["full_attention"]["rope_theta"]),
        layer_types=list(text["layer_types"]),
        activation_sparsity_pattern=list(text["activation_sparsity_pattern"]),
        **{name: text[name] for name in same},
    )


@dataclass
class EmbedderArgs:
    """A multimodal embedder's sizes: its own vocabulary's place in the token ids."""

    hidden_size: int
    vocab_offset: int
    vocab_size: int
    eps: float

    @classmethod
    def from_hf(cls, sub: dict, defaults: tuple[int, int, int]) -> "EmbedderArgs":
        hidden, offset, size = defaults
        return cls(sub.get("hidden_size", hidden), sub.get("vocab_offset", offset),
                   sub.get("vocab_size", size), sub.get("rms_norm_eps", 1e-6))


@dataclass
class ModelArgs:
    text: mlx_gemma3n.TextConfig
    vision: mobilenet_v5.MobileNetV5Config
    audio: gemma3n_audio.AudioConfig
    vision_embedder: EmbedderArgs
    audio_embedder: EmbedderArgs
    vision_soft_tokens_per_image: int
    audio_soft_tokens_per_image: int
    image_token_id: int
    audio_token_id: int

    @classmethod
    def from_hf(cls, config: dict) -> "ModelArgs":
        """From either layout: the Hub's (``rope_theta`` / ``rope_local_base_freq``) and
        transformers 5's (``rope_parameters`` per layer type); the defaults are
        transformers' (Gemma3nConfig's sub-configs)."""
        vision = config.get("vision_config") or {}
        audio = config.get("audio_config") or {}
        return cls(
            text=text_args(config),
            vision=mobilenet_v5.MobileNetV5Config.from_hf(vision),
            audio=gemma3n_audio.AudioConfig.from_hf(audio),
            vision_embedder=EmbedderArgs.from_hf(vision, (2048, 262_144, 128)),
            audio_embedder=EmbedderArgs.from_hf(audio, (1536, 262_272, 128)),
            vision_soft_tokens_per_image=config.get("vision_soft_tokens_per_image", 256),
            audio_soft_tokens_per_image=config.get("audio_soft_tokens_per_image", 188),
            image_token_id=config.get("image_token_id", 262_145),
            audio_token_id=config.get("audio_token_id", 262_273),
        )


# ------------------------------------------------------------------------- embedders


class MultimodalEmbedder(nn.Module):
    """Hard tokens (ids of this modality's vocabulary) or soft ones (tower features) into
    the text width: RMS norm, projection, RMS norm without a scale."""

    def __init__(self, args: EmbedderArgs, text_hidden_size: int):
        super().__init__()
        self.vocab_offset = args.vocab_offset
        self.embedding = nn.Embedding(args.vocab_size, args.hidden_size)
        self.hard_embedding_norm = nn.RMSNorm(args.hidden_size, eps=args.eps)
        self.soft_embedding_norm = nn.RMSNorm(args.hidden_size, eps=args.eps)
        self.embedding_projection = nn.Linear(args.hidden_size, text_hidden_size, bias=False)
        self.embedding_post_projection_norm = mlx_gemma3n.RMSNoScale(eps=args.eps)

    def hard(self, ids: mx.array) -> mx.array:
        return self._project(self.hard_embedding_norm(self.embedding(ids - self.vocab_offset)))

    def soft(self, features: mx.array) -> mx.array:
        return self._project(self.soft_embedding_norm(features))

    def _project(self, x: mx.array) -> mx.array:
        return self.embedding_post_projection_norm(self.embedding_projection(x))


class VisionTower(nn.Module):
    def __init__(self, config: mobilenet_v5.MobileNetV5Config):
        super().__init__()
        self.timm_model = mobilenet_v5.MobileNetV5Encoder(config)

    def __call__(self, pixels: mx.array) -> mx.array:
        return self.timm_model(pixels)


class LanguageModel(nn.Module):
    """mlx-lm's Gemma 3n text model under ``model`` (``language_model.model.*`` names)."""

    def __init__(self, args: mlx_gemma3n.TextConfig):
        super().__init__()
        self.model = mlx_gemma3n.LanguageModel(args)
        # KV-sharing layers read their keys and values from the cache of the layer they
        # share with; they have no projections of their own.
        for layer in self.model.layers:
            if layer.self_attn.is_kv_shared_layer:
                for name in SHARED_KV_MODULES:
                    delattr(layer.self_attn, name)
        # mlx-lm keeps the sparse layers' cut-off multiplier as a lazy array outside the
        # parameters; MLX evaluates a graph only on the thread that built it, so it is
        # made concrete here, before a server's engine thread first runs the model.
        mx.eval([layer.mlp._std_multiplier for layer in self.model.layers
                 if hasattr(layer.mlp, "_std_multiplier")])


def is_unused_weight(name: str, first_shared_layer: int) -> bool:
    """Tensors our tree does not hold: the shared layers' unused KV projections."""
    parts = name.split(".")
    if name.startswith("language_model.model.layers.") and parts[5:6] and parts[4] == "self_attn":
        return int(parts[3]) >= first_shared_layer and parts[5] in SHARED_KV_MODULES
    return False


# ---------------------------------------------------------------------------- model


class Model(VisionLanguageModel):
    feature_names = ("pixel_values", "input_features", "input_features_mask")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    mlx_prefixes = MLX_PREFIXES
    processor_class = "Gemma3nProcessor"
    image_processor_class = "SiglipImageProcessorPil"
    # mlx-lm's AltUp reads and rewrites these layers' weights itself: LoRA cannot wrap them.
    untunable_linears = ("altup.prediction_coefs", "altup.correction_coefs")
    # Their token embeddings (embed_tokens): every rank embeds the tokens it feeds back.
    kept_on_every_rank = ("embed_vision", "embed_audio")
    # The per-layer embeddings (E2B: 262,144 x 30 layers x 256): one row per token.
    gathered_tables = ("language_model.model.embed_tokens_per_layer",)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        text = args.text
        self.language_model = LanguageModel(text)
        self.vision_tower = VisionTower(args.vision)
        self.embed_vision = MultimodalEmbedder(args.vision_embedder, text.hidden_size)
        self.audio_tower = gemma3n_audio.AudioEncoder(args.audio)
        self.embed_audio = MultimodalEmbedder(args.audio_embedder, text.hidden_size)

    @property
    def first_shared_layer(self) -> int:
        return self.args.text.num_hidden_layers - self.args.text.num_kv_shared_layers

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        sanitized = map_hf_weights(
            weights, self.hf_to_mlx_name,
            towers={VISION_TOWER: mobilenet_v5.convert_hf_weight,
                    AUDIO_TOWER: gemma3n_audio.convert_hf_weight},
        )
        # The head is the token embeddings (tied), as mlx-lm's model computes it.
        sanitized.pop("language_model.lm_head.weight", None)
        return sanitized

    def load_weights(self, file_or_weights, strict: bool = True):
        if isinstance(file_or_weights, list):
            first = self.first_shared_layer
            file_or_weights = [(k, v) for k, v in file_or_weights if not is_unused_weight(k, first)]
        return super().load_weights(file_or_weights, strict=strict)

    # -- the contract -----------------------------------------------------------------

    def make_cache(self) -> list[Any]:
        # One cache per layer that computes keys and values; the shared layers read them.
        return self.language_model.model.make_cache()

    def embed_tokens(self, input_ids: mx.array) -> mx.array:
        """Text tokens through the scaled embedding table, vision and audio tokens through
        their embedders (as transformers' Gemma3nModel does)."""
        text_model = self.language_model.model
        vision, audio = self.embed_vision.vocab_offset, self.embed_audio.vocab_offset
        h = text_model.embed_tokens(input_ids)
        h = h * mx.array(self.args.text.hidden_size**0.5, dtype=h.dtype)
        is_vision = (input_ids >= vision) & (input_ids < audio)
        is_audio = input_ids >= audio
        if is_vision.any().item():
            hard = self.embed_vision.hard(mx.where(is_vision, input_ids, vision))
            h = mx.where(is_vision[..., None], hard.astype(h.dtype), h)
        if is_audio.any().item():
            hard = self.embed_audio.hard(mx.where(is_audio, input_ids, audio))
            h = mx.where(is_audio[..., None], hard.astype(h.dtype), h)
        return h

    def embed(self, input_ids: mx.array, pixel_values: Any = None, input_features: Any = None,
              input_features_mask: Any = None) -> tuple[mx.array, None]:
        features = None if pixel_values is None else self.image_features(pixel_values)
        h, ids = merge.embed_with_features(self.embed_tokens, input_ids, self.args.image_token_id,
                                           features)
        if input_features is not None:
            audio = self.audio_features(input_features, input_features_mask)
            h = merge.merge_features(h, merge.placeholder_positions(ids, self.args.audio_token_id),
                                     audio.reshape(-1, h.shape[-1]).astype(h.dtype), "audio tokens")
        return h, None

    def audio_features(self, input_features: Any, input_features_mask: Any) -> mx.array:
        """(clips, audio_soft_tokens_per_image, text width) from the feature extractor's
        log-mel frames and their mask (True: a frame of the clip)."""
        mel = mx.array(input_features) if not isinstance(input_features, mx.array) else input_features
        valid = mx.array(input_features_mask).astype(mx.bool_)
        dtype = self.embed_audio.embedding_projection.weight.dtype

        def encode(mel: mx.array, valid: mx.array) -> mx.array:
            encodings, kept = self.audio_tower(mel.astype(dtype), valid)
            soft = self.embed_audio.soft(encodings)
            # Padding frames and the tokens past the clip's: the last audio token's embedding.
            last = self.args.text.vocab_size - 1
            padding = self.embed_audio.hard(mx.array([last])).astype(soft.dtype)
            soft = mx.where(kept[..., None], soft, padding)
            missing = self.args.audio_soft_tokens_per_image - soft.shape[1]
            if missing < 0:
                raise ValueError(f"the audio tower gave {soft.shape[1]} tokens per clip, more "
                                 f"than the {self.args.audio_soft_tokens_per_image} the config allows")
            fill = mx.broadcast_to(padding, (soft.shape[0], missing, soft.shape[-1]))
            return mx.concatenate([soft, fill], axis=1)

        return cached_rows(self, "audio", encode, mel, valid)

    def image_features(self, pixel_values: Any) -> mx.array:
        """(images, soft tokens, text width) from the processor's (images, C, H, W)."""
        pixels = mx.array(pixel_values) if not isinstance(pixel_values, mx.array) else pixel_values
        dtype = self.embed_vision.embedding_projection.weight.dtype

        def encode(images: mx.array) -> mx.array:
            fused = self.vision_tower(images.transpose(0, 2, 3, 1).astype(dtype))
            tokens = fused.reshape(fused.shape[0], -1, fused.shape[-1])
            if tokens.shape[1] != self.args.vision_soft_tokens_per_image:
                raise ValueError(
                    f"the vision tower gave {tokens.shape[1]} tokens per image, the config "
                    f"says {self.args.vision_soft_tokens_per_image}"
                )
            scale = mx.array(tokens.shape[-1] ** 0.5, dtype=tokens.dtype)
            return self.embed_vision.soft(tokens * scale)

        return cached_rows(self, "image", encode, pixels)

    def __call__(
        self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False
    ) -> mx.array:
        # Without a cache the shared layers would have no keys to read: a fresh one.
        cache = cache if cache is not None else self.make_cache()
        text_model = self.language_model.model
        h = embeddings if embeddings is not None else self.embed_tokens(input_ids)
        logits = text_model(input_ids, cache=cache, input_embeddings=h)
        return logits[:, -1:] if last_only else logits


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
