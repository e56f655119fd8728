"""What every Qwen-VL family's ``Model`` shares (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5,
PaddleOCR-VL, the Omni thinkers): a vision tower over native-resolution patches whose
tokens replace the prompt's image and video placeholders, and a decoder positioned by
multimodal RoPE (M-RoPE), whose per-request state is an ``MRopeState``.

A family derives ``QwenVLModel`` once, builds its own ``vision_tower`` (anything with
``encode(pixels, grids) -> (tokens, deepstack_taps)``) and ``language_model`` in
``__init__``, writes its ``from_config``, and picks how videos are placed in time with
``video_positions`` (one of the ``*_spans`` functions below). Nothing here is meant to
be overridden method by method.

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
    MRopeState,
    TextConfig,
    VisionSpan,
    mrope_position_ids,
)
from mlxvlm.models.layers.qwen_vision import VisionConfig, convert_hf_weight, grids_thw
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

# The processor's image and video outputs ``embed_vision`` reads.
VISION_FEATURES = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


@dataclass
class ModelArgs:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    # Temporal M-RoPE step per second of video (Qwen2.5-VL); None: one step per frame grid.
    tokens_per_second: float | None = None


    @classmethod
    def from_hf(cls, config: dict, vision: VisionConfig) -> "ModelArgs":
        """A Qwen2-style M-RoPE model's arguments from its config, with the family's own
        reading of its vision config."""
        return cls(
            text=TextConfig.from_hf(config),
            vision=vision,
            image_token_id=token_id(config, "image_token", 151655),
            video_token_id=token_id(config, "video_token", 151656),
            tokens_per_second=vision_config(config).get("tokens_per_second"),
        )


# -- how a family places its videos in time (``QwenVLModel.video_positions``) ----------


def grid_step_spans(args, video_grids: np.ndarray, second_per_grid_ts: Any) -> list[VisionSpan]:
    """Qwen2-VL: each video's (t, h, w) grid, the temporal position one step per frame grid."""
    return [VisionSpan(tuple(g), 1.0) for g in video_grids]


def timed_spans(args, video_grids: np.ndarray, second_per_grid_ts: Any) -> list[VisionSpan]:
    """Qwen2.5-VL: temporal positions advance ``tokens_per_second`` per second of video."""
    # transformers' default when the config does not say
    tokens_per_second = 4 if args.tokens_per_second is None else args.tokens_per_second
    seconds = np.ones(len(video_grids), np.float32)
    if second_per_grid_ts is not None:
        seconds = np.asarray(second_per_grid_ts, dtype=np.float32).reshape(-1)
    return [VisionSpan(tuple(g), tokens_per_second * float(seconds[i]))
            for i, g in enumerate(video_grids)]


def frame_grids(video_grids: np.ndarray) -> np.ndarray:
    """Each video's (t, h, w) as t grids of (1, h, w): frames are prompted one by one."""
    return np.repeat(video_grids, video_grids[:, 0], axis=0) * np.array([0, 1, 1]) + [1, 0, 0]


def frame_spans(args, video_grids: np.ndarray, second_per_grid_ts: Any) -> list[VisionSpan]:
    """Qwen3-VL, Qwen3.5: frames are prompted one by one (each after its timestamp text),
    each its own (1, h, w) grid."""
    return [VisionSpan(tuple(g)) for g in frame_grids(video_grids)]


def join_deepstack(taps) -> DeepstackFeatures | None:
    """Images' and videos' DeepStack rows in prompt order (as transformers joins them);
    None where the tower taps none (every tower but Qwen3-VL's)."""
    if not taps or not taps[0][1]:
        return None
    positions = np.concatenate([p for p, _ in taps])
    order = np.argsort(positions, kind="stable")
    layers = [mx.concatenate([rows[i] for _, rows in taps])[mx.array(order)]
              for i in range(len(taps[0][1]))]
    mx.eval(layers)  # the loop evaluates embeddings and arrays, not this dataclass
    return DeepstackFeatures(positions[order], layers)


class QwenVLModel(VisionLanguageModel):
    """The shared Qwen-VL base: features in, M-RoPE state out. Its families set
    ``vision_tower`` and ``language_model`` (the M-RoPE decoder's call signature)."""

    feature_names = (*VISION_FEATURES, "second_per_grid_ts")
    hf_prefixes = HF_PREFIXES
    mlx_prefixes = (VISION_TOWER, "language_model.")
    processor_class = "Qwen2VLProcessor"
    image_processor_class = "Qwen2VLImageProcessorPil"
    # Whether the processor takes videos, and mlxvlm's numpy twin of the family's
    # transformers video processor that prepares them (and says how to sample frames).
    processor_videos = True
    video_processor_class = QwenVideoProcessor
    # Each video's M-RoPE span: (args, video grids, seconds per grid) -> [VisionSpan].
    video_positions = staticmethod(grid_step_spans)

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
            self.args.video_token_id: self.video_positions(self.args, video_grids,
                                                           second_per_grid_ts),
        }
        position_ids, delta = mrope_position_ids(ids, spans, self.args.vision.spatial_merge_size)
        return h, MRopeState(mx.array(position_ids), delta, join_deepstack(taps))

    def __call__(
        self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False
    ) -> mx.array:
        return self.language_model(input_ids, cache, embeddings, state, last_only)

    # -- the vision tower's tokens at the placeholders --------------------------------

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
        tower = self.vision_tower
        if active_cache(self) is None:
            return tower.encode(pixels, grids)
        per_item = split_rows(pixels, patches)
        merged = self.args.vision.spatial_merge_size**2

        def encode(indices: list[int]):
            if len(indices) == len(grids):
                batch = pixels
            else:
                batch = join_rows([per_item[i] for i in indices])
            features, deepstack = tower.encode(batch, grids[indices])
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
