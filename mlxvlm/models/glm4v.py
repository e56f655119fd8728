"""GLM-4.6V-Flash, GLM-4.1V (``glm4v``; Zhipu AI / Z.ai, 2025): a Qwen-VL-style model --
native-resolution patches whose tokens replace the prompt's placeholders, a decoder
positioned by multimodal RoPE -- with GLM's own tower (``layers/glm_vision.py``: a learned
position table resampled bicubically to each image's aspect ratio, a convolution merging
2 x 2 patches) and GLM-4's decoder under partial M-RoPE (``layers/glm_decoder.py``).

The prompt: an image is ``<|begin_of_image|>`` + one ``<|image|>`` per merged token +
``<|end_of_image|>``; a video is ``<|begin_of_video|>``, then per frame pair (one
temporal patch) an image block followed by its timestamp as text, then
``<|end_of_video|>``. Frames use the image token too: a run of ``<|image|>`` inside a
video block takes the next frame's features, and M-RoPE sees each frame as its own 1 x h
x w grid (transformers' ``get_rope_index`` via ``mm_token_type_ids``). Text after an
image continues ``max(h, w)`` past its start, as in Qwen2-VL.

The processor is transformers' ``Glm46VProcessor`` (GLM-4.6V's: timestamps as "1.0
seconds") or ``Glm4vProcessor`` (GLM-4.1V/4.5V's: whole seconds), whichever the
checkpoint names, over the PIL image processor and mlxvlm's numpy twin of its video
processor (``glm_video.py``: each samples frames its own way).

GLM-4.6V and GLM-4.5V (``glm4v_moe``) are this model with GLM-4.5's mixture-of-experts
decoder, which the config picks (``has_experts``). Checkpoint names are mlx-community's:
``vision_tower.*``, ``language_model.model.*`` (experts stacked as mlx-lm's
``mlp.switch_mlp.*``), ``language_model.lm_head``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
import mlx.core as mx
import numpy as np

from mlxvlm.models import merge
from mlxvlm.models.config_utils import token_id, vision_config
from mlxvlm.models.glm_video import Glm4vVideoProcessor, Glm46VVideoProcessor
from mlxvlm.models.layers.glm_decoder import GlmLanguageModel, GlmTextConfig
from mlxvlm.models.layers.glm_vision import GlmVisionConfig, GlmVisionTransformer, convert_hf_weight
from mlxvlm.models.layers.mrope_decoder import MRopeState, VisionSpan, mrope_position_ids
from mlxvlm.models.layers.qwen_vision import grids_thw
from mlxvlm.models.qwen3_vl_moe import split_experts, stack_expert_modules
from mlxvlm.models.qwen_vl_base import VISION_FEATURES, QwenVLModel, frame_grids
from mlxvlm.models.weights import map_hf_weights

VISION_TOWER = "vision_tower."
LM_HEAD = "language_model.lm_head.weight"
DECODER_LAYERS = "language_model.model.layers."
# Where frames' tokens are keyed apart from images' for the M-RoPE index: no token id is
# negative.
FRAME_MARK = -1
PROCESSORS = {
    # processor class -> its PIL image processor (both render images alike)
    "Glm46VProcessor": "Glm46VImageProcessorPil",
    "Glm4vProcessor": "Glm4vImageProcessorPil",
}
# processor class -> mlxvlm's numpy twin of its video processor
VIDEO_PROCESSORS = {"Glm46VProcessor": Glm46VVideoProcessor, "Glm4vProcessor": Glm4vVideoProcessor}


@dataclass
class ModelArgs:
    text: GlmTextConfig
    vision: GlmVisionConfig
    image_token_id: int
    video_start_token_id: int
    video_end_token_id: int
    # the template's <|video|>, which the processor replaces by frames of image tokens
    video_token_id: int | None = None

    @classmethod
    def from_hf(cls, config: dict, *, moe: bool) -> "ModelArgs":
        """transformers' Glm4vConfig (``moe``: Glm4vMoeConfig) in either layout."""
        image, video = (151363, 151364) if moe else (151343, 151344)
        return cls(
            text=GlmTextConfig.from_hf(config, moe=moe),
            vision=GlmVisionConfig.from_hf(vision_config(config)),
            image_token_id=token_id(config, "image_token", image),
            video_token_id=token_id(config, "video_token", video),
            video_start_token_id=token_id(config, "video_start_token", 151341),
            video_end_token_id=token_id(config, "video_end_token", 151342),
        )


def has_experts(config: dict) -> bool:
    """Whether the text model is GLM-4.5's mixture of experts (``glm4v_moe``, and
    transformers' ``glm46v`` over a ``glm4v_moe_text`` config)."""
    text = config.get("text_config") or {}
    return (config.get("model_type") == "glm4v_moe"
            or text.get("model_type") == "glm4v_moe_text"
            or bool(text.get("n_routed_experts") or config.get("n_routed_experts")))


def in_video_blocks(ids: np.ndarray, start: int, end: int) -> np.ndarray:
    """Per prompt position, whether it lies inside a ``start`` ... ``end`` video block (as
    transformers' ``create_mm_token_type_ids`` decides)."""
    return np.cumsum(ids == start) > np.cumsum(ids == end)


def checkpoint_processor_class(model_path: str | Path) -> str:
    """The processor class the checkpoint names (processor_config.json, then
    preprocessor_config.json); GLM-4.6V's where it names none or another."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = Path(model_path) / name
        if path.exists():
            named = json.loads(path.read_text()).get("processor_class")
            if named in PROCESSORS:
                return named
    return "Glm46VProcessor"


class Model(QwenVLModel):
    feature_names = VISION_FEATURES

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = GlmVisionTransformer(args.vision)
        self.language_model = GlmLanguageModel(args.text)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        return cls(ModelArgs.from_hf(config, moe=has_experts(config)))

    @staticmethod
    def cast_predicate(path: str) -> bool:
        """The MoE router's score-correction bias stays float32 when a conversion casts
        the rest (transformers keeps it so; mlx-lm's GLM-4.5 too)."""
        return not path.endswith("e_score_correction_bias")

    # -- checkpoint and processor -----------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The Hub's names to ours; layers past ``num_hidden_layers`` (GLM-4.5V's and
        GLM-4.6V's multi-token-prediction layer, which transformers ignores) left out."""
        sanitized = map_hf_weights(
            weights, self.hf_to_mlx_name, towers={VISION_TOWER: convert_hf_weight},
            drop={LM_HEAD} if self.args.text.tie_word_embeddings else (),
        )
        layers = self.args.text.num_hidden_layers
        sanitized = {name: value for name, value in sanitized.items()
                     if not name.startswith(DECODER_LAYERS)
                     or int(name[len(DECODER_LAYERS):].split(".")[0]) < layers}
        if self.args.text.is_moe:
            # the Hub's one tensor per expert, or transformers 5's fused (experts, out, in)
            sanitized = split_experts(stack_expert_modules(sanitized), self.args.text, True)
        return sanitized

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict, video: bool | None = None):
        """transformers' GLM-V processor (the one the checkpoint names) over the
        checkpoint's tokenizer, PIL image processor and chat template, and mlxvlm's numpy
        twin of its video processor (``video=False``: images only)."""
        import transformers

        from mlxvlm.models.processor_utils import image_only, tokenizer_and_chat_template

        processor_class = checkpoint_processor_class(model_path)
        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        image_processor = getattr(transformers, PROCESSORS[processor_class])
        video_processor = None
        if video is not False:
            video_processor = VIDEO_PROCESSORS[processor_class].from_pretrained(model_path)
        return image_only(getattr(transformers, processor_class))(
            image_processor=image_processor.from_pretrained(model_path),
            tokenizer=tokenizer, video_processor=video_processor, chat_template=chat_template,
        )

    # -- the contract -----------------------------------------------------------------

    def embed(self, input_ids: mx.array, pixel_values=None, image_grid_thw=None,
              pixel_values_videos=None, video_grid_thw=None) -> tuple[mx.array, MRopeState]:
        """The prompt's embeddings with the tower's tokens at the image placeholders --
        an image's, or a video frame's inside a video block -- and its M-RoPE state."""
        args = self.args
        ids = np.asarray(input_ids).reshape(-1)
        h = self.language_model.model.embed_tokens(input_ids)
        frames = in_video_blocks(ids, args.video_start_token_id, args.video_end_token_id)
        placeholders = ids == args.image_token_id
        image_grids = grids_thw(image_grid_thw)
        frame_grid_list = frame_grids(grids_thw(video_grid_thw))
        for kind, pixels, grids, where in (
            ("image", pixel_values, image_grids, placeholders & ~frames),
            ("video", pixel_values_videos, frame_grid_list, placeholders & frames),
        ):
            features = None
            if pixels is not None:
                features, _ = self.vision_features(pixels, grids, kind)
            h = merge.merge_features(h, np.flatnonzero(where), features,
                                     f"{kind} placeholder tokens (id {args.image_token_id})")
        marked = np.where(placeholders & frames, FRAME_MARK, ids)
        spans = {
            args.image_token_id: [VisionSpan(tuple(g)) for g in image_grids],
            FRAME_MARK: [VisionSpan(tuple(g)) for g in frame_grid_list],
        }
        position_ids, delta = mrope_position_ids(marked, spans, args.vision.spatial_merge_size)
        return h, MRopeState(mx.array(position_ids), delta)


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
