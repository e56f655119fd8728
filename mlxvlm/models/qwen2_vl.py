"""Qwen2-VL (Wang et al., 2024): a ViT with 2-D RoPE over native-resolution patches,
a merger folding each 2x2 block of patches into one token, and the Qwen2 decoder with
multimodal RoPE (M-RoPE) so that image tokens carry their (row, column) positions; a
video's temporal position steps by one per frame grid.

What every Qwen-VL family shares (placeholders, M-RoPE state, the feature cache, the
processor, checkpoint names) is ``qwen_vl_base.QwenVLModel``'s.
"""

from __future__ import annotations

from mlxvlm.models.config_utils import vision_config
from mlxvlm.models.layers.mrope_decoder import LanguageModel
from mlxvlm.models.layers.qwen_vision import QwenVisionTransformer, VisionConfig
from mlxvlm.models.qwen_vl_base import ModelArgs, QwenVLModel, grid_step_spans


def vision_config_from_hf(config: dict) -> VisionConfig:
    vision = vision_config(config)
    embed_dim = vision["embed_dim"]
    return VisionConfig.from_hf(
        vision,
        patch_size=14,
        hidden_act="quick_gelu",
        hidden_size=embed_dim,
        intermediate_size=int(embed_dim * vision.get("mlp_ratio", 4)),
        # Qwen2-VL's vision "hidden_size" is the merger's output width.
        out_hidden_size=vision["hidden_size"],
        norm="layernorm",
        mlp="fc",
    )


class Model(QwenVLModel):
    video_positions = staticmethod(grid_step_spans)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = QwenVisionTransformer(args.vision)
        self.language_model = LanguageModel(args.text)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        return cls(ModelArgs.from_hf(config, vision_config_from_hf(config)))


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
