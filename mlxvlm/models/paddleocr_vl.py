"""PaddleOCR-VL (Cui et al., 2025): a document/OCR model made of a NaViT-style SigLIP
tower over native-resolution patches with 2-D RoPE, a projector folding each 2x2 block of
patches into one token (``layers/navit_vision.py``), and the ERNIE-4.5 text decoder with
Qwen2-VL's multimodal RoPE, so that image tokens carry their (row, column) positions.

ERNIE-4.5 is the Llama-style decoder of ``layers/mrope_decoder.py`` with one ``use_bias``
switch for every projection, an explicit head size and M-RoPE sections in three blocks;
the prompt's M-RoPE ids are Qwen2-VL's (text after an image continues ``max(h, w)`` past
its start), so the family is a ``qwen_vl_base.QwenVLModel`` with its own tower and config.

Checkpoint names (as mlx-community publishes them): ``visual.embeddings.*``,
``visual.layers.N.self_attn.qkv`` (q/k/v fused), ``visual.post_layernorm``,
``visual.projector.*``, ``language_model.model.*`` and ``language_model.lm_head``, which
they store even where transformers ties it to the embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import text_config, token_id
from mlxvlm.models.layers.mrope_decoder import LanguageModel, TextConfig, default_mrope
from mlxvlm.models.layers.navit_vision import NavitVisionConfig, NavitVisionModel, convert_hf_weight
from mlxvlm.models.processor_utils import tokenizer_and_chat_template
from mlxvlm.models.qwen_vl_base import QwenVLModel
from mlxvlm.models.weights import (
    LM_HEAD_NAMES,
    TEXT_MODEL_NAMES,
    fuse_linears,
    map_hf_weights,
)

# Hugging Face name prefix -> ours: transformers 5's module tree first, then the Hub's
# original names (which transformers 5.24's save_pretrained writes too).
HF_PREFIXES = (
    ("model.visual.vision_model.encoder.", "visual."),
    ("model.visual.vision_model.", "visual."),
    ("model.projector.", "visual.projector."),
    ("visual.vision_model.encoder.", "visual."),
    ("visual.vision_model.", "visual."),
    ("mlp_AR.", "visual.projector."),
    TEXT_MODEL_NAMES,
    ("model.", "language_model.model."),
    LM_HEAD_NAMES,
)
MLX_PREFIXES = ("visual.embeddings.", "visual.layers.", "visual.post_layernorm.",
                "visual.projector.", "language_model.")
VISION_TOWER = "visual."
VISION_QKV = ("q_proj", "k_proj", "v_proj")
LM_HEAD = "language_model.lm_head.weight"
EMBED_TOKENS = "language_model.model.embed_tokens.weight"
IMAGE_TOKEN = "<|IMAGE_PLACEHOLDER|>"


def text_config_from_hf(config: dict) -> TextConfig:
    """ERNIE-4.5's settings in either layout; defaults are transformers'
    PaddleOCRTextConfig's. The output head is always built (see ``ties_embeddings``)."""
    text = text_config(config, 500_000.0)
    rope = default_mrope(text, "PaddleOCR-VL")
    heads = text.get("num_attention_heads", 16)
    hidden = text.get("hidden_size", 1024)
    bias = bool(text.get("use_bias") or False)
    return TextConfig(
        hidden_size=hidden,
        num_hidden_layers=text.get("num_hidden_layers", 18),
        intermediate_size=text.get("intermediate_size", 3072),
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads", 2) or heads,
        vocab_size=text.get("vocab_size", 103424),
        rms_norm_eps=text.get("rms_norm_eps", 1e-5),
        rope_theta=rope["rope_theta"],
        mrope_section=tuple(rope.get("mrope_section", (16, 24, 24))),
        max_position_embeddings=text.get("max_position_embeddings", 131072),
        tie_word_embeddings=False,
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=bias,
        explicit_head_dim=text.get("head_dim", 128) or hidden // heads,
    )


def ties_embeddings(config: dict) -> bool:
    """Whether transformers ties the output head to the embeddings: unless both the top
    level and the text config say false. The Hub's flat layout has no text config of its
    own, whose default (true) then wins over a top-level false."""
    nested = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", True)) or bool(
        nested.get("tie_word_embeddings", True)
    )


@dataclass
class ModelArgs:
    text: TextConfig
    vision: NavitVisionConfig
    image_token_id: int
    video_token_id: int  # reserved in the vocabulary; PaddleOCR-VL takes no video
    tie_word_embeddings: bool = True
    tokens_per_second: float | None = None


class Model(QwenVLModel):
    feature_names = ("pixel_values", "image_grid_thw")
    hf_prefixes = HF_PREFIXES
    mlx_prefixes = MLX_PREFIXES
    processor_class = "PaddleOCRVLProcessor"
    image_processor_class = "PaddleOCRVLImageProcessorPil"
    processor_videos = False

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.visual = NavitVisionModel(args.vision)
        self.language_model = LanguageModel(args.text)

    # The tower where the Qwen-VL code looks for it (checkpoints name it ``visual``).
    vision_tower = property(lambda self: self.visual)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        text = text_config_from_hf(config)
        return cls(
            ModelArgs(
                text=text,
                vision=NavitVisionConfig.from_hf(config.get("vision_config") or {}, text.hidden_size),
                image_token_id=token_id(config, "image_token", 100295),
                video_token_id=token_id(config, "video_token", 100296),
                tie_word_embeddings=ties_embeddings(config),
            )
        )

    # -- checkpoint and processor -----------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        sanitized = map_hf_weights(weights, self.hf_to_mlx_name,
                                   towers={VISION_TOWER: convert_hf_weight})
        if self.args.tie_word_embeddings and EMBED_TOKENS in sanitized:
            # transformers' head is then the embedding matrix, whatever lm_head holds.
            sanitized[LM_HEAD] = sanitized[EMBED_TOKENS]
        return fuse_linears(sanitized, "visual.layers.", VISION_QKV, "qkv")

    def hf_split_modules(self, name: str) -> tuple[tuple[str, int], ...] | None:
        """A tower block's fused ``self_attn.qkv``: transformers' ``q_proj``, ``k_proj``
        and ``v_proj``, each as wide as the tower."""
        block, _, leaf = name.rpartition(".")
        if leaf != "qkv" or not name.startswith("visual.layers."):
            return None
        hf_block = VisionLanguageModel.hf_module_name(self, block)
        return tuple((f"{hf_block}.{part}", self.args.vision.hidden_size) for part in VISION_QKV)

    def hf_module_name(self, name: str) -> str:
        if self.hf_split_modules(name) is not None:
            raise NotImplementedError(
                f"{name!r} is three linear layers in transformers (q, k, v); see hf_split_modules"
            )
        return super().hf_module_name(name)

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict, video: bool | None = None):
        """transformers' PaddleOCR-VL processor over the checkpoint's tokenizer (given its
        image token where tokenizer_config.json does not name it) and the PIL image
        processor."""
        import transformers

        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        if getattr(tokenizer, "image_token", None) is None:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                model_path, extra_special_tokens={"image_token": IMAGE_TOKEN}
            )
        image_processor = getattr(transformers, cls.image_processor_class)
        return getattr(transformers, cls.processor_class)(
            image_processor=image_processor.from_pretrained(model_path),
            tokenizer=tokenizer,
            chat_template=chat_template,
        )


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
