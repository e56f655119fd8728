"""Qwen3-VL (Qwen team, 2025): Qwen2-VL's design with three changes.

- The ViT adds a learned absolute position table, bilinearly resampled to each image's
  patch grid, and taps its hidden states after a few blocks (``deepstack_visual_indexes``)
  through extra mergers: DeepStack adds those features to the image tokens' hidden
  states after the first decoder layers.
- The decoder is Qwen3's (per-head q/k RMSNorm, explicit head size) with *interleaved*
  M-RoPE: rotary frequencies cycle through time, height and width.
- Videos are prompted frame by frame, each frame's tokens preceded by a text timestamp
  ("<1.5 seconds>"), so M-RoPE sees every frame as its own 1 x h x w grid and time is
  carried by the timestamp text rather than by the temporal axis.

Checkpoint names (mlx-community's): ``vision_tower.*`` (``patch_embed``, ``pos_embed``,
``blocks``, ``merger``, ``deepstack_merger_list``), ``language_model.model.*`` and
``language_model.lm_head`` unless tied — the Qwen-VL names ``qwen_vl_base`` maps. DeepStack's
rows reach the decoder through ``qwen_vl_base.join_deepstack``.
"""

from __future__ import annotations

from mlxvlm.models.config_utils import text_config, token_id, vision_config
from mlxvlm.models.layers.mrope_decoder import LanguageModel, TextConfig, default_mrope
from mlxvlm.models.layers.qwen_vision import QwenVisionTransformer, VisionConfig
from mlxvlm.models.qwen_video import Qwen3VideoProcessor
from mlxvlm.models.qwen_vl_base import (
    VISION_FEATURES,
    ModelArgs,
    QwenVLModel,
    frame_spans,
)

# transformers' Qwen3VLTextConfig.default_theta
DEFAULT_ROPE_THETA = 500_000.0


def text_config_from_hf(config: dict, default_rope_theta: float = DEFAULT_ROPE_THETA) -> TextConfig:
    """The decoder's switches from either config layout (defaults: transformers')."""
    text = text_config(config, default_rope_theta)
    rope = default_mrope(text, "Qwen3-VL")
    heads = text["num_attention_heads"]
    # transformers 5 writes the expert count as num_local_experts
    moe = text.get("num_experts") or text.get("num_local_experts") or 0
    return TextConfig(
        hidden_size=text["hidden_size"],
        num_hidden_layers=text["num_hidden_layers"],
        intermediate_size=text["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        vocab_size=text["vocab_size"],
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope["rope_theta"],
        mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))),
        max_position_embeddings=text.get("max_position_embeddings", 128_000),
        tie_word_embeddings=text["tie_word_embeddings"],
        attention_bias=text.get("attention_bias", False),
        explicit_head_dim=text.get("head_dim") or None,
        qk_norm=True,
        o_proj_bias=text.get("attention_bias", False),
        # transformers interleaves whatever the config's "mrope_interleaved" says.
        mrope_interleaved=True,
        num_experts=moe,
        num_experts_per_tok=text.get("num_experts_per_tok", 0) if moe else 0,
        moe_intermediate_size=text.get("moe_intermediate_size", 0) if moe else 0,
        decoder_sparse_step=text.get("decoder_sparse_step", 1) or 1,
        mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
        # Qwen3-VL-MoE's router always renormalizes its top-k weights.
        norm_topk_prob=True,
    )


def vision_config_from_hf(config: dict, default_deepstack=(8, 16, 24)) -> VisionConfig:
    """Qwen3-VL's tower; ``default_deepstack``: the taps where the config names none
    (Qwen3.5's tower, the same one without DeepStack, passes ())."""
    vision = vision_config(config)
    return VisionConfig.from_hf(
        vision,
        patch_size=16, hidden_act="gelu_pytorch_tanh",
        norm="layernorm", mlp="linear_fc", patch_bias=True, merger="linear_fc",
        num_position_embeddings=vision.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=tuple(vision.get("deepstack_visual_indexes", default_deepstack)),
    )


class Model(QwenVLModel):
    feature_names = VISION_FEATURES
    processor_class = "Qwen3VLProcessor"
    video_processor_class = Qwen3VideoProcessor
    video_positions = staticmethod(frame_spans)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = QwenVisionTransformer(args.vision)  # DeepStack taps included
        self.language_model = LanguageModel(args.text)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        return cls(
            ModelArgs(
                text=text_config_from_hf(config),
                vision=vision_config_from_hf(config),
                image_token_id=token_id(config, "image_token", 151655),
                video_token_id=token_id(config, "video_token", 151656),
            )
        )


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
