"""Qwen2.5-VL (Bai et al., 2025): Qwen2-VL with a leaner ViT — RMSNorm and SwiGLU blocks,
attention within windows of ``window_size`` pixels except in the few
``fullatt_block_indexes`` blocks — and M-RoPE whose temporal axis follows absolute time
(``tokens_per_second``) for videos. The decoder and everything else are Qwen2-VL's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mlxvlm.models import qwen2_vl
from mlxvlm.models.config_utils import rope_parameters, vision_config
from mlxvlm.models.layers.qwen_vision import VisionConfig
from mlxvlm.models.qwen2_vl import is_hf_checkpoint  # noqa: F401 (part of the contract)


def vision_config_from_hf(config: dict) -> VisionConfig:
    vision = vision_config(config)
    return VisionConfig(
        depth=vision["depth"],
        hidden_size=vision["hidden_size"],
        num_heads=vision["num_heads"],
        intermediate_size=vision["intermediate_size"],
        out_hidden_size=vision["out_hidden_size"],
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        in_channels=vision.get("in_channels", 3),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        hidden_act=vision.get("hidden_act", "silu"),
        norm="rmsnorm",
        mlp="gated",
        window_size=vision.get("window_size", 112),
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
        rope_theta=rope_parameters(vision, 10000.0)["rope_theta"],
    )


class Model(qwen2_vl.Model):
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


def load_processor(model_path: str | Path, config: dict):
    from transformers import Qwen2_5_VLProcessor

    return qwen2_vl.load_processor(model_path, config, processor_class=Qwen2_5_VLProcessor)
