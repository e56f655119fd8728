"""MiniCPM-V 4.6 (OpenBMB, 2026; transformers' ``minicpmv4_6``).

The processor resizes a picture to about ``scale_resolution``² pixels (sides multiples of
four patches) and, when it is larger, also cuts a resized copy into a grid of slices whose
aspect ratio is closest to the picture's (at most ``max_slice_nums``); every view is
packed as a row of patches. The tower (``layers/minicpmv_vision.py``) sees each view at
its own patch grid, its window merger folding 2 x 2 patches into one token on the way;
the merger then folds 2 x 2 of those once more (``merger_times`` rounds), each through a
LayerNorm + GELU MLP, the last one to the text width: a view of ``h x w`` patches gives
``h * w / 16`` tokens. They replace the image tokens (the whole picture's between
``<image>`` and ``</image>``, then each slice's between ``<slice>`` and ``</slice>``, rows
of slices on their own lines) ahead of Qwen3.5's hybrid text model (linear and full
attention, ``layers/hybrid_decoder.py``), whose positions are plain text positions.

A video's sampled frames (one a second) are pictures of their own: each frame and its
slices through the same tower, their features in place of the video tokens
(``<|video_pad|>``, in ``<image>`` / ``<slice>`` runs as an image's), after the video's
``<image_id>``; the processor's video half is mlxvlm's numpy twin (``minicpm_video.py``).

Checkpoint names (mlx-community's): ``vision_tower.*``, ``vit_merger.*`` (transformers'
``vision_tower.vit_merger``), ``merger.mlp.N.*``, ``language_model.model.*`` and
``language_model.lm_head`` unless tied, ``language_model.mtp.*`` for the Hub's
multi-token-prediction head (``mtp.*``: Qwen3.5's, ``layers/mtp_head.py``), which drafts
for ``--mtp`` and is left out where a checkpoint has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import merge, qwen3_5
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it
from mlxvlm.models.feature_cache import cached_features
from mlxvlm.models.layers import minicpmv_vision
from mlxvlm.models.layers.hybrid_decoder import HybridLanguageModel, HybridTextConfig
from mlxvlm.models.layers.mrope_decoder import MRopeState
from mlxvlm.models.layers.mtp_head import MTP, MtpHead, MtpTarget, mtp_target
from mlxvlm.models.layers.pixel_shuffle import fold_blocks
from mlxvlm.models.minicpm_video import MiniCPMVideoProcessor
from mlxvlm.models.processor_utils import image_only, read_chat_template
from mlxvlm.models.weights import (
    LM_HEAD_NAMES,
    TEXT_MODEL_NAMES,
    is_hf_unless_quantized,
    map_hf_weights,
)

# Hugging Face name prefix -> ours: transformers' module tree (the Hub's checkpoints).
HF_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("model.vision_tower.vit_merger.", "vit_merger."),
    ("vision_tower.vit_merger.", "vit_merger."),
    ("model.merger.", "merger."),
    TEXT_MODEL_NAMES,
    LM_HEAD_NAMES,
    ("mtp.", f"{MTP}."),  # the multi-token-prediction head (``--mtp``)
)
TOWER = "vision_tower."
LM_HEAD = "language_model.lm_head.weight"
DOWNSAMPLE_MODES = ("16x", "4x")


@dataclass(frozen=True)
class ModelArgs:
    text: HybridTextConfig
    vision: minicpmv_vision.MiniCPMVisionConfig
    image_token_id: int
    video_token_id: int | None
    use_window_merger: bool  # downsample_mode "16x" (else "4x": 4x the tokens)
    merge_kernel: int
    merger_times: int

    @classmethod
    def from_hf(cls, config: dict, model_type: str = "minicpmv4_6") -> "ModelArgs":
        """``config`` read with the defaults of transformers' config class for
        ``model_type`` (MiniCPM-OCR's differ: ``"4x"``, tied embeddings)."""
        full = as_transformers_reads_it({**config, "model_type": model_type})
        mode = full["downsample_mode"]
        if mode not in DOWNSAMPLE_MODES:
            raise ValueError(f"unknown downsample_mode {mode!r} (one of {DOWNSAMPLE_MODES})")
        kernel = tuple(full["merge_kernel_size"])
        if len(set(kernel)) != 1:
            raise NotImplementedError(f"MiniCPM-V's merger with kernel {list(kernel)}")
        text = {**full["text_config"], "tie_word_embeddings": full["tie_word_embeddings"]}
        return cls(
            text=qwen3_5.text_config_from_hf({"text_config": text}),
            vision=minicpmv_vision.MiniCPMVisionConfig.from_hf(full["vision_config"],
                                                              full["insert_layer_id"]),
            image_token_id=full["image_token_id"],
            video_token_id=full.get("video_token_id"),
            use_window_merger=mode == "16x",
            merge_kernel=kernel[0],
            merger_times=full["merger_times"],
        )


class DownsampleMLP(nn.Module):
    def __init__(self, width: int, out: int):
        super().__init__()
        self.pre_norm = nn.LayerNorm(width, eps=1e-6)
        self.linear_1 = nn.Linear(width, width)
        self.linear_2 = nn.Linear(width, out)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(nn.gelu(self.linear_1(self.pre_norm(x))))


class Merger(nn.Module):
    """``merger_times`` rounds of folding ``kernel x kernel`` squares of tokens into one,
    each through its MLP; the last one's output is the text width."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.kernel = args.merge_kernel
        width = args.vision.hidden_size * self.kernel**2
        outs = [args.vision.hidden_size] * (args.merger_times - 1) + [args.text.hidden_size]
        self.mlp = [DownsampleMLP(width, out) for out in outs]

    def __call__(self, x: mx.array, rows: int, columns: int) -> mx.array:
        """(tokens, D) of a ``rows x columns`` grid -> (tokens / kernel^(2 rounds), text width)."""
        for mlp in self.mlp:
            x = mlp(fold_blocks(x, rows, columns, self.kernel))
            rows, columns = rows // self.kernel, columns // self.kernel
        return x


def text_state(length: int) -> MRopeState:
    """Plain text positions on all three M-RoPE axes (transformers' default position ids
    for MiniCPM-V's Qwen3.5 text model)."""
    return MRopeState(mx.broadcast_to(mx.arange(length, dtype=mx.int32), (3, length)), 0)


def build_processor(image_processor, tokenizer, chat_template: str | None, video_processor,
                    processor_class: str = "MiniCPMV4_6Processor"):
    """transformers' ``processor_class`` (MiniCPM-V 4.6's, or MiniCPM-OCR's, the same
    class under its own name) over the PIL image processor and mlxvlm's numpy video
    processor."""
    import transformers

    return image_only(getattr(transformers, processor_class))(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
        chat_template=chat_template,
    )


def load_minicpm_processor(model_path: str | Path, image_processor_class: type,
                           video_processor_class: type, processor_class: str):
    """The checkpoint's tokenizer, chat template, image and video settings (read by the
    numpy ``image_processor_class`` and ``video_processor_class``) under transformers'
    ``processor_class``."""
    from transformers import AutoTokenizer

    model_path = Path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    chat_template = read_chat_template(model_path) or getattr(tokenizer, "chat_template", None)
    return build_processor(image_processor_class.from_pretrained(model_path), tokenizer,
                           chat_template, video_processor_class.from_pretrained(model_path),
                           processor_class)


class Model(VisionLanguageModel):
    feature_names = ("pixel_values", "target_sizes", "pixel_values_videos", "target_sizes_videos")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES
    optional_parts = (MTP,)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = minicpmv_vision.MiniCPMVisionModel(args.vision)
        self.vit_merger = minicpmv_vision.WindowMerger(args.vision)
        self.merger = Merger(args)
        self.language_model = HybridLanguageModel(args.text)
        if args.text.mtp_num_hidden_layers:
            self.language_model.mtp = MtpHead(args.text)

    def multi_token_predictor(self) -> MtpTarget:
        return mtp_target(self.language_model)

    # -- checkpoint and processor -----------------------------------------------------

    @classmethod
    def is_hf_checkpoint(cls, weight_names) -> bool:
        """Hugging Face's unless quantized (see ``weights.is_hf_unless_quantized``)."""
        return is_hf_unless_quantized(weight_names, lambda n: cls.hf_to_mlx_name(n) != n)

    cast_predicate = staticmethod(qwen3_5.Model.cast_predicate)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        renamed = map_hf_weights(
            weights, self.hf_to_mlx_name,
            towers={TOWER: minicpmv_vision.convert_hf_weight},
            drop={LM_HEAD} if self.args.text.tie_word_embeddings else (),
        )
        return qwen3_5.hybrid_text_weights(renamed)

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        from transformers import MiniCPMV4_6ImageProcessorPil

        return load_minicpm_processor(model_path, MiniCPMV4_6ImageProcessorPil,
                                      MiniCPMVideoProcessor, "MiniCPMV4_6Processor")

    # -- the contract -----------------------------------------------------------------

    def make_cache(self) -> list:
        return self.language_model.model.make_cache()

    def __call__(self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False):
        return self.language_model(input_ids, cache, embeddings, state, last_only)

    def embed(self, input_ids: mx.array, pixel_values: Any = None, target_sizes: Any = None,
              pixel_values_videos: Any = None,
              target_sizes_videos: Any = None) -> tuple[mx.array, MRopeState]:
        features = None
        if pixel_values is not None:
            features = self.image_features(pixel_values, target_sizes)
        h, ids = merge.embed_with_features(
            self.language_model.model.embed_tokens, input_ids, self.args.image_token_id,
            features, "image tokens",
        )
        if self.args.video_token_id is not None:
            # a video's frames are views as a picture's are
            frames = None
            if pixel_values_videos is not None:
                frames = self.image_features(pixel_values_videos, target_sizes_videos)
            h = merge.merge_features(h, merge.placeholder_positions(ids, self.args.video_token_id),
                                     frames, "video tokens")
        elif pixel_values_videos is not None:
            raise ValueError("video frames were given but the config names no video token")
        return h, text_state(ids.size)

    def image_features(self, pixel_values: Any, target_sizes: Any) -> mx.array:
        """(tokens, text width) for the processor's views -- (1, C, p, patches * p) pixels,
        each view's patches side by side, and their (views, 2) patch grids -- view after
        view (each picture, then its slices). Each view is encoded on its own, so views
        seen before come from the model's feature cache."""
        pixels = np.asarray(pixel_values, dtype=np.float32)[0]
        sizes = np.asarray(target_sizes).reshape(-1, 2).astype(np.int64)
        C, p = pixels.shape[0], pixels.shape[1]
        patches = pixels.reshape(C, p, -1, p).transpose(2, 1, 3, 0)  # (patches, p, p, C)
        counts = sizes.prod(axis=1)
        if counts.sum() != patches.shape[0]:
            raise ValueError(f"got {patches.shape[0]} patches but the views' grids "
                             f"{sizes.tolist()} call for {counts.sum()}")
        starts = np.concatenate([[0], np.cumsum(counts)])
        items = [(patches[starts[i]:starts[i + 1]], sizes[i]) for i in range(len(sizes))]
        dtype = self.vision_tower.post_layernorm.weight.dtype  # never quantized
        window_merger = self.vit_merger if self.args.use_window_merger else None

        def encode(indices: list[int]) -> list[tuple[mx.array]]:
            out = []
            for i in indices:
                view, (rows, columns) = items[i]
                h, rows, columns = self.vision_tower(
                    mx.array(view).astype(dtype), int(rows), int(columns), window_merger)
                out.append((self.merger(h[0], rows, columns),))
            return out

        views = cached_features(self, "image view", items, encode)
        return mx.concatenate([v[0] for v in views])


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
