"""Qwen2-VL (Wang et al., 2024): a ViT with 2-D RoPE over native-resolution patches,
a merger folding each 2x2 block of patches into one token, and the Qwen2 decoder with
multimodal RoPE (M-RoPE) so that image tokens carry their (row, column) positions.

Checkpoint names (as mlx-community publishes them): ``vision_tower.*`` for the ViT and
merger, ``language_model.model.*`` for the decoder, ``language_model.lm_head`` unless
the embeddings are tied.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import numpy as np

from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import rope_parameters, token_id, vision_config
from mlxvlm.models.feature_cache import active_cache, cached_features, join_rows, split_rows
from mlxvlm.models.layers.mrope_decoder import (
    LanguageModel,
    MRopeState,
    TextConfig,
    VisionSpan,
    mrope_position_ids,
)
from mlxvlm.models.layers.qwen_vision import QwenVisionTransformer, VisionConfig

# Hugging Face name prefix -> ours, first match wins. Checkpoints from the Hub use
# `visual.` / `model.`; those saved by transformers 4.52-4.57 use the nested module names.
HF_PREFIXES = (
    ("model.visual.", "vision_tower."),
    ("visual.", "vision_tower."),
    ("model.language_model.", "language_model.model."),
    ("model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)
MLX_PREFIXES = ("vision_tower.", "language_model.")


def is_hf_checkpoint(weight_names: Iterable[str]) -> bool:
    """Whether tensors are named as in Hugging Face checkpoints (else: already ours)."""
    names = list(weight_names)
    hf = [n for n in names if n.startswith(tuple(p for p, _ in HF_PREFIXES))]
    if hf and len(hf) != len(names):
        mlx_names = [n for n in names if n.startswith(MLX_PREFIXES)]
        if mlx_names:
            raise ValueError(
                "the checkpoint mixes Hugging Face tensor names (e.g. "
                f"{hf[0]!r}) with MLX ones (e.g. {mlx_names[0]!r}); it is neither layout"
            )
    return bool(hf)


def hf_to_mlx_name(name: str) -> str:
    for prefix, replacement in HF_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


def vision_config_from_hf(config: dict) -> VisionConfig:
    vision = vision_config(config)
    embed_dim = vision["embed_dim"]
    return VisionConfig(
        depth=vision["depth"],
        hidden_size=embed_dim,
        num_heads=vision["num_heads"],
        intermediate_size=int(embed_dim * vision.get("mlp_ratio", 4)),
        # Qwen2-VL's vision "hidden_size" is the merger's output width.
        out_hidden_size=vision["hidden_size"],
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        in_channels=vision.get("in_channels", 3),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        hidden_act=vision.get("hidden_act", "quick_gelu"),
        norm="layernorm",
        mlp="fc",
        rope_theta=rope_parameters(vision, 10000.0)["rope_theta"],
    )


@dataclass
class ModelArgs:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    # Temporal M-RoPE step per second of video (Qwen2.5-VL); None: one step per frame grid.
    tokens_per_second: float | None = None


class Model(VisionLanguageModel):
    feature_names = (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    )

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vision_tower = QwenVisionTransformer(args.vision)
        self.language_model = LanguageModel(args.text)

    @classmethod
    def vision_config_from_hf(cls, config: dict) -> VisionConfig:
        return vision_config_from_hf(config)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        return cls(
            ModelArgs(
                text=TextConfig.from_hf(config),
                vision=cls.vision_config_from_hf(config),
                image_token_id=token_id(config, "image_token", 151655),
                video_token_id=token_id(config, "video_token", 151656),
                tokens_per_second=vision_config(config).get("tokens_per_second"),
            )
        )

    # -- checkpoint -----------------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        sanitized = {}
        for name, value in weights.items():
            if name.endswith("inv_freq"):  # rotary tables, recomputed from the config
                continue
            name = hf_to_mlx_name(name)
            if name == "vision_tower.patch_embed.proj.weight":
                # PyTorch Conv3d (out, in, t, h, w) -> MLX (out, t, h, w, in)
                value = value.transpose(0, 2, 3, 4, 1)
            if name == "language_model.lm_head.weight" and self.args.text.tie_word_embeddings:
                continue
            sanitized[name] = value
        return sanitized

    # -- the contract -----------------------------------------------------------------

    @property
    def layers(self):
        return self.language_model.model.layers

    @property
    def max_context(self) -> int:
        return self.args.text.max_position_embeddings

    @property
    def placeholder_token_ids(self) -> set[int]:
        return {self.args.image_token_id, self.args.video_token_id}

    def embed(
        self,
        input_ids: mx.array,
        pixel_values: Any = None,
        image_grid_thw: Any = None,
        pixel_values_videos: Any = None,
        video_grid_thw: Any = None,
        second_per_grid_ts: Any = None,
    ) -> tuple[mx.array, MRopeState]:
        ids = np.asarray(input_ids).reshape(-1)
        h = self.language_model.model.embed_tokens(input_ids)
        image_grids = _grids(image_grid_thw)
        video_grids = _grids(video_grid_thw)
        h = self._merge_features(h, ids, self.args.image_token_id, pixel_values, image_grids)
        h = self._merge_features(h, ids, self.args.video_token_id, pixel_values_videos, video_grids)

        spans = {
            self.args.image_token_id: [VisionSpan(tuple(g)) for g in image_grids],
            self.args.video_token_id: [
                VisionSpan(tuple(g), self.video_time_interval(i, second_per_grid_ts))
                for i, g in enumerate(video_grids)
            ],
        }
        position_ids, delta = mrope_position_ids(ids, spans, self.args.vision.spatial_merge_size)
        return h, MRopeState(mx.array(position_ids), delta)

    def __call__(
        self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False
    ) -> mx.array:
        return self.language_model(input_ids, cache, embeddings, state, last_only)

    # -- helpers ----------------------------------------------------------------------

    def video_time_interval(self, index: int, second_per_grid_ts: Any) -> float:
        """Qwen2-VL steps the temporal position by one per frame grid."""
        return 1.0

    def vision_features(self, pixels: Any, grids: np.ndarray, kind: str = "image"):
        """The vision tower's tokens for ``pixels`` -- the patch rows of every image (or
        video) one after another -- with their (t, h, w) ``grids``, and the DeepStack taps
        (Qwen3-VL; else an empty list). Each image or video is looked up in the model's
        feature cache first; the tower runs, batched, on the others only. Attention never
        crosses a frame, so an image's tokens do not depend on its batch."""
        pixels = mx.array(pixels) if not isinstance(pixels, mx.array) else pixels
        grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
        patches = grids.prod(axis=1)
        if pixels.shape[0] != patches.sum():
            raise ValueError(
                f"got {pixels.shape[0]} {kind} patch rows but the grids {grids.tolist()} call "
                f"for {patches.sum()}"
            )
        if active_cache(self) is None:
            return self.vision_tower.encode(pixels, grids)
        per_item = split_rows(pixels, patches)
        merged = self.args.vision.spatial_merge_size**2

        def encode(indices: list[int]):
            if len(indices) == len(grids):
                batch = pixels
            else:
                batch = join_rows([per_item[i] for i in indices])
            features, deepstack = self.vision_tower.encode(batch, grids[indices])
            tokens = patches[indices] // merged
            return list(zip(*(split_rows(f, tokens) for f in (features, *deepstack))))

        outputs = cached_features(self, kind, list(zip(per_item, grids)), encode)
        columns = [join_rows(column) for column in zip(*outputs)]
        return columns[0], columns[1:]

    def _merge_features(self, h, ids, token, pixels, grids) -> mx.array:
        """Run the vision tower and put its tokens at the placeholder positions."""
        positions = np.flatnonzero(ids == token)
        if pixels is None:
            if positions.size:
                raise ValueError(
                    f"the prompt has {positions.size} placeholder tokens (id {token}) but no "
                    "pixel values were given for them"
                )
            return h
        kind = "video" if token == self.args.video_token_id else "image"
        features, _ = self.vision_features(pixels, grids, kind)
        if features.shape[0] != positions.size:
            raise ValueError(
                f"the vision tower produced {features.shape[0]} tokens but the prompt has "
                f"{positions.size} placeholder tokens (id {token}) for them"
            )
        merged = h[0]
        merged[mx.array(positions)] = features.astype(h.dtype)
        return merged[None]


def _grids(grid_thw: Any) -> np.ndarray:
    if grid_thw is None:
        return np.zeros((0, 3), dtype=np.int64)
    return np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)


def load_processor(
    model_path: str | Path, config: dict, processor_class: type | None = None, video: bool = True
):
    """The transformers processor (tokenizer + PIL image processor + chat template), built
    without torchvision: videos go through mlxvlm's numpy twin of the video processor
    (``video=False``: images only)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    from mlxvlm.models.processor_utils import image_only, read_chat_template
    from mlxvlm.models.qwen_video import QwenVideoProcessor

    processor_class = processor_class or Qwen2VLProcessor
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
    chat_template = read_chat_template(model_path) or getattr(tokenizer, "chat_template", None)
    return image_only(processor_class)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=QwenVideoProcessor.from_pretrained(model_path) if video else None,
        chat_template=chat_template,
    )
