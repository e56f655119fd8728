"""Qwen2.5-VL (Bai et al., 2025): Qwen2-VL with a leaner ViT — RMSNorm and SwiGLU blocks,
attention within windows of ``window_size`` pixels except in the few
``fullatt_block_indexes`` blocks — and M-RoPE whose temporal axis follows absolute time
(``tokens_per_second``) for videos. The decoder and everything else are Qwen2-VL's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxvlm.models import qwen2_vl
from mlxvlm.models.config_utils import vision_config
from mlxvlm.models.layers.qwen_vision import VisionConfig


def vision_config_from_hf(config: dict) -> VisionConfig:
    vision = vision_config(config)
    return VisionConfig.from_hf(
        vision,
        patch_size=14, hidden_act="silu",
        norm="rmsnorm", mlp="gated",  # RMSNorm and SwiGLU blocks
        window_size=vision.get("window_size", 112),
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
    )


class Model(qwen2_vl.Model):
    processor_class = "Qwen2_5_VLProcessor"

    @classmethod
    def vision_config_from_hf(cls, config: dict) -> VisionConfig:
        return vision_config_from_hf(config)

    def video_time_interval(self, index: int, second_per_grid_ts: Any) -> float:
        """Temporal positions advance ``tokens_per_second`` per second of video."""
        seconds = 1.0
        if second_per_grid_ts is not None:
            seconds = float(np.asarray(second_per_grid_ts, dtype=np.float32).reshape(-1)[index])
        tokens_per_second = self.args.tokens_per_second
        # transformers' default when the config does not say
        return (4 if tokens_per_second is None else tokens_per_second) * seconds


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
