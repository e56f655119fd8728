"""PaliGemma 2 (Steiner et al., 2024): a SigLIP image encoder, one linear projection into
the Gemma 2 text model, and a prefix-LM: the images and the text prompt (the "prefix")
attend to each other in both directions, the answer (the "suffix") is causal.

The decoder reuses mlx-lm's Gemma 2 blocks with masks built here, since no mlx-lm model
takes a prefix-LM mask: within the prompt every token sees every other; later tokens see
everything before them (the sliding-window layers only the last ``sliding_window``).
The prompt is one bidirectional span, so the generate loop prefills it in one chunk
(``bidirectional_spans``). transformers numbers positions from 1 here; RoPE depends only
on position differences, so counting from the cache offset (0) gives the same attention.

PaliGemma is single-turn: the processor puts the images first, then ``<bos>``, the
prompt and a newline. Its checkpoints carry no chat template; ``load_processor`` gives
the processor one that renders a single user turn that way, so chat messages work too.

Checkpoint names (mlx-community's, which are also the Hub's originals):
``vision_tower.vision_model.*``, ``multi_modal_projector.linear``,
``language_model.model.*``; the output head is tied to the embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import gemma, gemma2
from mlx_lm.models.base import create_attention_mask

from mlxvlm.models import merge
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import as_transformers_reads_it, decoder_sizes
from mlxvlm.models.layers import siglip
from mlxvlm.models.layers.blocks import ScaledEmbeddingDecoder
from mlxvlm.models.processor_utils import tokenizer_and_chat_template
from mlxvlm.models.weights import (
    NESTED_TOWER_NAMES, PROJECTOR_NAMES, TEXT_MODEL_NAMES, map_hf_weights,
)

# Hugging Face name prefix -> ours. The Hub's original checkpoints
# (transformers 4.4x) use our names; transformers 5 nests the modules under `model.` and
# drops the SigLIP tower's `vision_model.` level (and writes a tied `lm_head`).
HF_PREFIXES = (TEXT_MODEL_NAMES, PROJECTOR_NAMES, *NESTED_TOWER_NAMES)
VISION_TOWER = "vision_tower.vision_model."

# A single user turn: every image first, then the text (the processor adds <bos>, "\n").
CHAT_TEMPLATE = (
    "{%- if messages | length != 1 or messages[0]['role'] != 'user' -%}"
    "{{ raise_exception('PaliGemma takes exactly one user turn (no system prompt, no "
    "history); give one user message with the image(s) and the prompt') }}"
    "{%- endif -%}"
    "{%- set content = messages[0]['content'] -%}"
    "{%- if content is string -%}{{ content }}{%- else -%}"
    "{%- for part in content if part['type'] == 'image' -%}<image>{%- endfor -%}"
    "{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
)


# Every name a PaliGemma checkpoint has, Hugging Face's or ours (see is_hf_checkpoint).
CHECKPOINT_PREFIXES = (
    "model.", "lm_head.", "vision_tower.", "language_model.", "multi_modal_projector.",
)


# ----------------------------------------------------------------------------- config


# The text models PaliGemma's family builds: PaliGemma 2's Gemma 2. (PaliGemma 1's Gemma
# is built for ColPali, ``models/colpali.py``, whose parity is tested; generation with it
# is not, so the family itself still refuses it.)
GENERATIVE_TEXT_MODELS = ("gemma2",)


@dataclass
class ModelArgs:
    text: gemma2.ModelArgs | gemma.ModelArgs
    vision: siglip.SiglipVisionConfig
    image_token_id: int
    projection_dim: int
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, config: dict,
                text_models: tuple[str, ...] = GENERATIVE_TEXT_MODELS) -> "ModelArgs":
        """From either layout; the Hub's sub-configs name only what differs from the
        defaults, so the config is read through transformers' own classes.
        ``text_models``: the text model types accepted ("gemma2", "gemma")."""
        config = as_transformers_reads_it(config)
        text = config["text_config"]
        if text["model_type"] not in text_models:
            raise NotImplementedError(
                f"PaliGemma with a {text['model_type']!r} text model is not supported "
                f"({', '.join(text_models)} is)"
            )
        rope = text["rope_parameters"]
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope type {rope['rope_type']!r} is not supported")
        if text["model_type"] == "gemma":  # Gemma 1: full attention in every layer
            layer_types = ["full_attention"] * text["num_hidden_layers"]
            text_args = gemma.ModelArgs(model_type="gemma", **decoder_sizes(text),
                                        rope_theta=float(rope["rope_theta"]))
        else:
            layer_types = text.get("layer_types") or [
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(text["num_hidden_layers"])
            ]
            text_args = gemma2.ModelArgs(
                model_type="gemma2",
                **decoder_sizes(text),
                rope_theta=float(rope["rope_theta"]),
                attn_logit_softcapping=text["attn_logit_softcapping"],
                final_logit_softcapping=text["final_logit_softcapping"],
                query_pre_attn_scalar=text["query_pre_attn_scalar"],
            )
        return cls(
            text=text_args,
            vision=siglip.SiglipVisionConfig.from_hf(config["vision_config"]),
            image_token_id=config["image_token_index"],
            projection_dim=config["projection_dim"],
            sliding_window=text.get("sliding_window"),
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            max_position_embeddings=text["max_position_embeddings"],
        )


# -------------------------------------------------------------------------- decoder


@dataclass
class Prefix:
    """The prompt's prefix-LM part: its first ``length`` tokens attend bidirectionally."""

    length: int

    @staticmethod
    def batch(states) -> None:
        """Decoding needs no prefix: generated tokens are causal."""
        return None

    def prefix(self, length: int) -> "Prefix":
        """Prompt-cache reuse of the first ``length`` tokens: only of the whole prefix,
        whose attention looked ahead to its end."""
        if 0 < length < self.length:
            raise NotImplementedError(
                "a reused prompt prefix cannot end inside PaliGemma's bidirectional prefix"
            )
        return Prefix(min(length, self.length))


def prefix_lm_mask(offset: int, n: int, prefix: int, window: int | None) -> mx.array:
    """(n, offset + n) bool: the queries at ``[offset, offset + n)`` over every key so far.
    Causal (within ``window`` of the query if given), and open among the first ``prefix``
    positions (transformers ORs its bidirectional block into both kinds of layer)."""
    queries = mx.arange(offset, offset + n)[:, None]
    keys = mx.arange(offset + n)[None]
    allowed = keys <= queries
    if window is not None:
        allowed = allowed & (keys > queries - window)
    return allowed | ((queries < prefix) & (keys < prefix))


class TextModel(ScaledEmbeddingDecoder):
    """mlx-lm's Gemma 2 (or Gemma) blocks under Gemma's scaled embeddings
    (``language_model.model``)."""

    def __init__(self, args: ModelArgs):
        text = args.text
        blocks = gemma if text.model_type == "gemma" else gemma2
        layers = [blocks.TransformerBlock(text) for _ in range(text.num_hidden_layers)]
        if blocks is gemma:
            # transformers runs every Gemma's MLP with the tanh GELU (a config's "gelu"
            # is read as it), which mlx-lm's Gemma 2 MLP has and its Gemma one has not.
            for layer in layers:
                layer.mlp = gemma2.MLP(text.hidden_size, text.intermediate_size)
        super().__init__(text.vocab_size, text.hidden_size, layers,
                         blocks.RMSNorm(text.hidden_size, eps=text.rms_norm_eps))
        self.args = args

    def masks(self, h: mx.array, cache: Any, prefix: int) -> dict[bool, Any]:
        """The mask of the full and of the sliding-window layers for this call."""
        offset, n = (cache.offset if cache is not None else 0), h.shape[1]
        # A batched decode cache has per-row offsets (an array): every row is past its
        # prompt there, since the engine prefills each request on its own.
        in_prefix = isinstance(offset, int) and offset < prefix
        masks = {}
        for sliding in set(self.args.sliding_layers):
            window = self.args.sliding_window if sliding else None
            if in_prefix:
                masks[sliding] = prefix_lm_mask(offset, n, prefix, window)
            else:  # past the prefix: plain (sliding) causal attention
                mask = create_attention_mask(h, cache, window_size=window, return_array=True)
                masks[sliding] = self._for_grouped_heads(mask)
        return masks

    def padded_masks(self, lengths: mx.array, length: int) -> dict[bool, Any]:
        """Masks for a right-padded batch of whole prefixes (``lengths``: each row's
        tokens): every token sees every token of its own row, in both kinds of layer."""
        keys = mx.arange(length)[None] < lengths[:, None]
        mask = self._for_grouped_heads(keys[:, None, None, :])
        return {sliding: mask for sliding in set(self.args.sliding_layers)}

    def _for_grouped_heads(self, mask: Any) -> Any:
        """mlx-lm's Gemma 2 attention splits the query heads per key/value head into a
        5-D (B, kv, repeats, L, S) score array; a batched cache's per-row mask (B, 1, L, S)
        must gain that axis to broadcast by row."""
        # Gemma 2's attention only (Gemma 1's keeps 4-D scores), with the layers' own
        # counts: a tensor-parallel rank holds its share of the heads.
        attention = self.pipeline_layers[0].self_attn
        grouped = (self.args.text.model_type == "gemma2"
                   and attention.n_heads != attention.n_kv_heads)
        if grouped and isinstance(mask, mx.array) and mask.ndim == 4:
            return mx.expand_dims(mask, 2)
        return mask

    runs_pipelined = True

    def __call__(self, h: mx.array, cache: list[Any], prefix: int,
                 masks: dict[bool, Any] | None = None) -> mx.array:
        """``masks``: given (``padded_masks``), instead of the prefix-LM's. Pipelined, this
        rank's run of layers (and their caches) between receive and hand_on; otherwise
        all of them."""
        masks = masks if masks is not None else self.masks(h, cache[0], prefix)
        sliding_layers = self.args.sliding_layers[self.start_idx:self.end_idx]
        h = self.receive(h)
        for layer, c, sliding in zip(self.pipeline_layers, cache, sliding_layers):
            h = layer(h, masks[sliding], c)
        return self.norm(self.hand_on(h, cache))


class LanguageModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.softcap = getattr(args.text, "final_logit_softcapping", None)
        self.model = TextModel(args)

    def __call__(
        self, h: mx.array, cache: list[Any], prefix: int, last_only: bool = False
    ) -> mx.array:
        h = self.model(h, cache, prefix)
        logits = self.model.embed_tokens.as_linear(h[:, -1:] if last_only else h)
        if self.softcap is not None:
            logits = mx.tanh(logits / self.softcap) * self.softcap
        return logits


class MultiModalProjector(nn.Module):
    def __init__(self, vision_width: int, text_width: int):
        super().__init__()
        self.linear = nn.Linear(vision_width, text_width)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear(x)


# ---------------------------------------------------------------------------- model


class Model(VisionLanguageModel):
    feature_names = ("pixel_values", "token_type_ids")
    args_class = ModelArgs
    hf_prefixes = HF_PREFIXES

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision_tower = siglip.SiglipVisionModel(args.vision)
        self.multi_modal_projector = MultiModalProjector(args.vision.hidden_size, args.projection_dim)
        self.language_model = LanguageModel(args)

    @classmethod
    def is_hf_checkpoint(cls, weight_names: Iterable[str]) -> bool:
        """Hugging Face checkpoints name tensors like ours (the Hub's originals) or under
        ``model.``/``lm_head.`` (transformers 5): always true of names. The loader tells
        MLX conversions apart by their writer's mark (``{"format": "mlx"}`` metadata)."""
        return any(name.startswith(CHECKPOINT_PREFIXES) for name in weight_names)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # The head is the embeddings (transformers 5 still writes a tied `lm_head`).
        return map_hf_weights(
            weights, self.hf_to_mlx_name, towers={VISION_TOWER: siglip.convert_hf_weight},
            skip_prefixes=("lm_head.",),
        )

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        """transformers' PaliGemmaProcessor with the PIL SigLIP image processor, and a
        single-turn chat template when the checkpoint has none."""
        from transformers import PaliGemmaProcessor, SiglipImageProcessorPil

        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        return PaliGemmaProcessor(
            image_processor=SiglipImageProcessorPil.from_pretrained(model_path),
            tokenizer=tokenizer,
            chat_template=chat_template or CHAT_TEMPLATE,
        )

    # -- the contract -----------------------------------------------------------------

    @property
    def max_context(self) -> int:
        return self.args.max_position_embeddings

    def bidirectional_spans(self, state: Prefix | None) -> list[tuple[int, int]]:
        return [(0, state.length)] if state is not None and state.length > 1 else []

    def embed(
        self, input_ids: mx.array, pixel_values: Any = None, token_type_ids: Any = None
    ) -> tuple[mx.array, Prefix]:
        h, ids = merge.embed_image_tokens(self, input_ids, pixel_values)
        return h, Prefix(prefix_length(ids, token_type_ids))

    def image_features(self, pixel_values: Any) -> mx.array:
        """(images, patches, text width) from the processor's (images, C, H, W)."""
        # The compute dtype: a norm's (a linear layer's weight may stay 16-bit on the CPU,
        # see mlxvlm.cpu.half_weights, and may be quantized).
        dtype = self.vision_tower.vision_model.post_layernorm.weight.dtype
        return siglip.projected_image_features(self, pixel_values, dtype)

    def __call__(
        self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False
    ) -> mx.array:
        h, cache = self.language_model.model.start(input_ids, cache, embeddings)
        prefix = state.length if isinstance(state, Prefix) else 0
        return self.language_model(h, cache, prefix, last_only)


def prefix_length(ids: np.ndarray, token_type_ids: Any) -> int:
    """Tokens up to the first suffix token (type 1); the whole prompt without types."""
    if token_type_ids is None:
        return len(ids)
    suffix = np.flatnonzero(np.asarray(token_type_ids).reshape(-1) != 0)
    return int(suffix[0]) if suffix.size else len(ids)


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
