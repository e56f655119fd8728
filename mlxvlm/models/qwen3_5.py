"""Qwen3.5 (Qwen team, 2026): Qwen3-VL's vision tower (without DeepStack) over a hybrid
decoder whose layers are mostly Gated DeltaNet linear attention, every
``full_attention_interval``-th one gated full attention (``layers/hybrid_decoder.py``).

Images are prompted as in Qwen3-VL (interleaved M-RoPE over the vision grids, rotating
only the first quarter of each attention head). The linear layers' state is fixed-size
per sequence: a rotating KV cache (``max_kv_size``) bounds the attention layers only,
and a quantized KV cache (``kv_bits``) quantizes only them.

Checkpoint names (mlx-community's): ``vision_tower.*``, ``language_model.model.*``,
``language_model.lm_head`` unless tied, ``language_model.mtp.*`` for the
multi-token-prediction head (``layers/mtp_head.py``: it drafts for ``--mtp``); Hugging
Face's are the module tree's (``model.visual.*``, ``model.language_model.*``,
``lm_head``) and ``mtp.*``. A checkpoint without the head's tensors (an mlx-lm conversion
drops them) loads without it. transformers stores the decoder's RMSNorm weights
zero-centred (it scales by ``1 + weight``) and the depthwise convolution as (channels, 1,
kernel); ``sanitize`` writes them as MLX's ``nn.RMSNorm`` and ``nn.Conv1d`` take them.
"""

from __future__ import annotations

import mlx.core as mx

from mlxvlm.models import qwen3_vl
from mlxvlm.models.layers.mtp_head import MTP, MtpHead, MtpTarget, mtp_target
from mlxvlm.models.config_utils import text_config, token_id
from mlxvlm.models.layers.hybrid_decoder import (
    FULL,
    LINEAR,
    HybridLanguageModel,
    HybridTextConfig,
)
from mlxvlm.models.layers.mrope_decoder import default_mrope
from mlxvlm.models.layers.qwen_vision import QwenVisionTransformer
from mlxvlm.models.qwen_video import Qwen3VideoProcessor
from mlxvlm.models.qwen_vl_base import HF_PREFIXES, VISION_FEATURES, ModelArgs, QwenVLModel, frame_spans

# transformers' PreTrainedConfig.default_theta (Qwen3.5 configs always name theirs).
DEFAULT_ROPE_THETA = 10_000.0
# Norms transformers scales by (1 + weight): the decoder's, not the linear layers' gated one.
ZERO_CENTRED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "language_model.model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    f"{MTP}.norm.weight",
    ".pre_fc_norm_embedding.weight",
    ".pre_fc_norm_hidden.weight",
)



def layer_types(text: dict) -> tuple[str, ...]:
    """Each layer's kind: the config's ``layer_types``, else every
    ``full_attention_interval``-th layer full attention (transformers' rule)."""
    if text.get("layer_types"):
        return tuple(text["layer_types"])
    interval = text.get("full_attention_interval", 4)
    return tuple(LINEAR if (i + 1) % interval else FULL for i in range(text["num_hidden_layers"]))


def text_config_from_hf(config: dict) -> HybridTextConfig:
    """The decoder's switches from either config layout (defaults: transformers')."""
    text = text_config(config, DEFAULT_ROPE_THETA)
    rope = default_mrope(text, "Qwen3.5")
    heads = text["num_attention_heads"]
    moe = text.get("num_experts") or 0
    return HybridTextConfig(
        hidden_size=text["hidden_size"],
        num_hidden_layers=text["num_hidden_layers"],
        intermediate_size=text.get("intermediate_size", 0),
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or 256,
        vocab_size=text["vocab_size"],
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope.get("partial_rotary_factor",
                                       text.get("partial_rotary_factor", 0.25)),
        mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        tie_word_embeddings=text["tie_word_embeddings"],
        layer_types=layer_types(text),
        linear_num_value_heads=text.get("linear_num_value_heads", 32),
        linear_num_key_heads=text.get("linear_num_key_heads", 16),
        linear_key_head_dim=text.get("linear_key_head_dim", 128),
        linear_value_head_dim=text.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
        attention_bias=text.get("attention_bias", False),
        num_experts=moe,
        num_experts_per_tok=text.get("num_experts_per_tok", 0) if moe else 0,
        moe_intermediate_size=text.get("moe_intermediate_size", 0) if moe else 0,
        shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0) if moe else 0,
        # Qwen3.5-MoE's router always renormalizes its top-k weights.
        norm_topk_prob=True,
        mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0),
    )


class Model(QwenVLModel):
    # Images and videos are prompted as Qwen3-VL prompts them.
    feature_names = VISION_FEATURES
    processor_class = "Qwen3VLProcessor"
    video_processor_class = Qwen3VideoProcessor
    video_positions = staticmethod(frame_spans)
    hf_prefixes = HF_PREFIXES + (("mtp.", f"{MTP}."),)
    optional_parts = (MTP,)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = QwenVisionTransformer(args.vision)  # Qwen3-VL's, no DeepStack
        self.language_model = HybridLanguageModel(args.text)
        if args.text.mtp_num_hidden_layers:
            self.language_model.mtp = MtpHead(args.text)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        return cls(
            ModelArgs(
                text=text_config_from_hf(config),
                vision=qwen3_vl.vision_config_from_hf(config, default_deepstack=()),
                image_token_id=token_id(config, "image_token", 248056),
                video_token_id=token_id(config, "video_token", 248057),
            )
        )

    @staticmethod
    def cast_predicate(path: str) -> bool:
        """The linear attention's ``A_log`` stays float32 when a conversion casts the rest
        (as mlx-lm's and mlx-community's Qwen3.5 keep it)."""
        return not path.endswith("A_log")

    def make_cache(self) -> list:
        """A KV cache per attention layer, mlx-lm's ``ArraysCache`` (convolution window,
        recurrent state) per linear layer."""
        return self.language_model.model.make_cache()

    def multi_token_predictor(self) -> MtpTarget:
        return mtp_target(self.language_model)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return hybrid_text_weights(super().sanitize(weights))


def hybrid_text_weights(renamed: dict[str, mx.array]) -> dict[str, mx.array]:
    """The hybrid text model's tensors (under our ``language_model.`` names) as MLX's
    layers take them: zero-centred norms plus one, the depthwise convolution moved to
    (channels, kernel, 1). Other tensors pass through."""
    for name, value in renamed.items():
        if name.endswith(ZERO_CENTRED_NORMS) and name.startswith("language_model."):
            renamed[name] = value + 1.0
        elif name.endswith(".linear_attn.conv1d.weight"):
            renamed[name] = value.moveaxis(2, 1)  # (C, 1, K) -> MLX's (C, K, 1)
    return renamed


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
