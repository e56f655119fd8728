"""Qwen2.5-VL (Bai et al., 2025): Qwen2-VL with a leaner ViT — RMSNorm and SwiGLU blocks,
attention within windows of ``window_size`` pixels except in the few
``fullatt_block_indexes`` blocks — and M-RoPE whose temporal axis follows absolute time
(``tokens_per_second``) for videos. The decoder is Qwen2-VL's (``layers/mrope_decoder.py``);
the rest is ``qwen_vl_base.QwenVLModel``'s.
"""

from __future__ import annotations

from mlxvlm.models.config_utils import vision_config
from mlxvlm.models.layers.mrope_decoder import LanguageModel
from mlxvlm.models.layers.qwen_vision import QwenVisionTransformer, VisionConfig
from mlxvlm.models.qwen_vl_base import ModelArgs, QwenVLModel, timed_spans


def vision_config_from_hf(config: dict) -> VisionConfig:
    vision = vision_config(config)
    return VisionConfig.from_hf(
        vision,
        patch_size=14, hidden_act="silu",
        norm="rmsnorm", mlp="gated",  # RMSNorm and SwiGLU blocks
        window_size=vision.get("window_size", 112),
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
    )


class Model(QwenVLModel):
    processor_class = "Qwen2_5_VLProcessor"
    video_positions = staticmethod(timed_spans)

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
