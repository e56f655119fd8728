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
from typing import Any

import mlx.core as mx
import numpy as np

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import token_id, vision_config
from mlxvlm.models.feature_cache import active_cache, cached_features, join_rows, split_rows
from mlxvlm.models.layers.mrope_decoder import (
    DeepstackFeatures,
    LanguageModel,
    MRopeState,
    TextConfig,
    VisionSpan,
    mrope_position_ids,
)
from mlxvlm.models.layers.qwen_vision import (
    QwenVisionTransformer,
    VisionConfig,
    convert_hf_weight,
    grids_thw,
)
from mlxvlm.models.processor_utils import image_only, tokenizer_and_chat_template
from mlxvlm.models.qwen_video import QwenVideoProcessor
from mlxvlm.models.weights import LM_HEAD_NAMES, TEXT_MODEL_NAMES, map_hf_weights

# Hugging Face name prefix -> ours. Checkpoints from the Hub use `visual.` / `model.`;
# those saved by transformers 4.52-4.57 use the nested module names.
HF_PREFIXES = (
    ("model.visual.", "vision_tower."),
    ("visual.", "vision_tower."),
    TEXT_MODEL_NAMES,
    ("model.", "language_model.model."),
    LM_HEAD_NAMES,
)
VISION_TOWER = "vision_tower."
LM_HEAD = "language_model.lm_head.weight"


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
    hf_prefixes = HF_PREFIXES
    mlx_prefixes = (VISION_TOWER, "language_model.")
    processor_class = "Qwen2VLProcessor"
    image_processor_class = "Qwen2VLImageProcessorPil"
    # Whether the processor takes videos, and mlxvlm's numpy twin of the family's
    # transformers video processor that prepares them (and says how to sample frames).
    processor_videos = True
    video_processor_class = QwenVideoProcessor

    def __init__(self, args: ModelArgs):
        super().__init__(args)
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

    # -- checkpoint and processor -----------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return map_hf_weights(
            weights, self.hf_to_mlx_name, towers={VISION_TOWER: convert_hf_weight},
            drop={LM_HEAD} if self.args.text.tie_word_embeddings else (),
        )

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict, video: bool | None = None):
        """The transformers processor (tokenizer + PIL image processor + chat template),
        built without torchvision: videos go through mlxvlm's numpy twin of the video
        processor (``video=False``: images only; None: ``processor_videos``)."""
        import transformers

        video = cls.processor_videos if video is None else video
        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        image_processor = getattr(transformers, cls.image_processor_class)
        return image_only(getattr(transformers, cls.processor_class))(
            image_processor=image_processor.from_pretrained(model_path),
            tokenizer=tokenizer,
            video_processor=cls.video_processor_class.from_pretrained(model_path) if video else None,
            chat_template=chat_template,
        )

    # -- the contract -----------------------------------------------------------------

    def embed(
        self, input_ids: mx.array, second_per_grid_ts: Any = None, **vision: Any
    ) -> tuple[mx.array, MRopeState]:
        """``vision``: the processor's images and videos (see ``embed_vision``)."""
        h, ids, (image_grids, video_grids), taps = self.embed_vision(input_ids, **vision)
        spans = {
            self.args.image_token_id: [VisionSpan(tuple(g)) for g in image_grids],
            self.args.video_token_id: self.video_spans(video_grids, second_per_grid_ts),
        }
        position_ids, delta = mrope_position_ids(ids, spans, self.args.vision.spatial_merge_size)
        return h, MRopeState(mx.array(position_ids), delta, self.deepstack(taps))

    def __call__(
        self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False
    ) -> mx.array:
        return self.language_model(input_ids, cache, embeddings, state, last_only)

    # -- helpers ----------------------------------------------------------------------

    def video_spans(self, video_grids: np.ndarray, second_per_grid_ts: Any) -> list[VisionSpan]:
        """Each video's M-RoPE span: its (t, h, w) grid, stepped in time as
        ``video_time_interval`` says."""
        return [
            VisionSpan(tuple(g), self.video_time_interval(i, second_per_grid_ts))
            for i, g in enumerate(video_grids)
        ]

    def video_time_interval(self, index: int, second_per_grid_ts: Any) -> float:
        """Qwen2-VL steps the temporal position by one per frame grid."""
        return 1.0

    def deepstack(self, taps: list) -> DeepstackFeatures | None:
        """The DeepStack features from ``embed_vision``'s taps: none in Qwen2-VL."""
        return None

    def vision_features(self, pixels: Any, grids: np.ndarray, kind: str = "image"):
        """The vision tower's tokens for ``pixels`` -- the patch rows of every image (or
        video) one after another -- with their (t, h, w) ``grids``, and the DeepStack taps
        (Qwen3-VL; else an empty list). Each image or video is looked up in the model's
        feature cache first; the tower runs, batched, on the others only. Attention never
        crosses a frame, so an image's tokens do not depend on its batch."""
        pixels = mx.array(pixels) if not isinstance(pixels, mx.array) else pixels
        grids = grids_thw(grids)
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

    def embed_vision(self, input_ids, pixel_values=None, image_grid_thw=None,
                     pixel_values_videos=None, video_grid_thw=None):
        """The prompt's token embeddings with the tower's tokens at the image and video
        placeholders, the flat prompt ids, the (image, video) grids, and for each kind
        that brought pixels its placeholder positions and DeepStack rows (Qwen3-VL)."""
        ids = np.asarray(input_ids).reshape(-1)
        h = self.language_model.model.embed_tokens(input_ids)
        grids, taps = [], []
        for kind, token, pixels, grid_thw in (
            ("image", self.args.image_token_id, pixel_values, image_grid_thw),
            ("video", self.args.video_token_id, pixel_values_videos, video_grid_thw),
        ):
            grids.append(grids_thw(grid_thw))
            positions = merge.placeholder_positions(ids, token)
            features = None
            if pixels is not None:
                features, deepstack = self.vision_features(pixels, grids[-1], kind)
                taps.append((positions, deepstack))
            h = merge.merge_features(h, positions, features, f"placeholder tokens (id {token})")
        return h, ids, tuple(grids), taps


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
