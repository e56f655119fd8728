"""A text decoder from mlx-lm, picked by the text config's ``model_type``.

Families whose text model is a stock LLM (LLaVA's llama/mistral/qwen2, ...) reuse
mlx-lm's model file through its ``input_embeddings`` argument instead of writing their own.
The mlx-lm ``Model`` is used as is, so its parameters are named ``model.*`` and
``lm_head.*`` — under a family's ``language_model`` attribute that gives the
``language_model.model.*`` names of mlx-community's checkpoints. ``MlxLmDecoder`` is the
family contract's decoder side for such a model.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import mlx.nn as nn

# Hugging Face model_type -> mlx-lm module, where mlx-lm implements one with another.
MLX_LM_MODULES = {
    "mistral": "llama",
}


def mlx_lm_module(model_type: str):
    name = MLX_LM_MODULES.get(model_type, model_type)
    try:
        return importlib.import_module(f"mlx_lm.models.{name}")
    except ImportError:
        raise NotImplementedError(
            f"text model type {model_type!r} has no mlx-lm implementation (mlx_lm.models.{name})"
        ) from None


def _layer_types(text: dict) -> list[str] | None:
    """Per-layer attention kinds as transformers applies them. Mistral's config has no
    ``layer_types``: a ``sliding_window`` there means every layer slides."""
    if text.get("layer_types"):
        return list(text["layer_types"])
    if text.get("sliding_window") is not None and "use_sliding_window" not in text:
        return ["sliding_attention"] * text["num_hidden_layers"]
    return None


def _slides_everywhere(layer_types: list[str] | None) -> bool:
    return bool(layer_types) and all(t == "sliding_attention" for t in layer_types)


def max_context(text: dict) -> int | None:
    """The longest sequence the mlx-lm model computes exactly as transformers does.

    mlx-lm's llama needs at least one full-attention layer, so a text model whose every
    layer slides (Mistral with a ``sliding_window``) runs full attention — the same
    maths while the whole sequence fits in the window, which therefore bounds it."""
    length = text.get("max_position_embeddings")
    if _slides_everywhere(_layer_types(text)):
        window = text["sliding_window"]
        length = window if length is None else min(length, window)
    return length


def model_args(text: dict) -> Any:
    """mlx-lm's ``ModelArgs`` from a complete transformers text config (standardized
    ``rope_parameters``, ``tie_word_embeddings`` resolved; see config_utils)."""
    module = mlx_lm_module(text["model_type"])
    fields = {f.name for f in dataclasses.fields(module.ModelArgs)}
    rope = dict(text["rope_parameters"])
    values = {k: v for k, v in text.items() if k in fields}
    if "num_experts" in fields and "num_experts" not in values and "num_local_experts" in text:
        # transformers 5 writes Qwen3-MoE's expert count under the name it maps to
        values["num_experts"] = text["num_local_experts"]
    values["rope_theta"] = float(rope.pop("rope_theta"))
    values["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    values["tie_word_embeddings"] = bool(text["tie_word_embeddings"])

    layer_types = _layer_types(text)
    if _slides_everywhere(layer_types):
        layer_types = None  # full attention, bounded by ``max_context``
    mixed = layer_types is not None and "sliding_attention" in layer_types
    if mixed and not {"layer_types", "sliding_window"} <= fields:
        raise NotImplementedError(
            f"mlx-lm's {text['model_type']} model has no sliding-window attention, which "
            "this checkpoint's text config asks for"
        )
    if "layer_types" in fields:
        values["layer_types"] = layer_types
        values["sliding_window"] = text.get("sliding_window") if mixed else None
    return module.ModelArgs.from_dict(values)


def text_model(args: Any) -> nn.Module:
    """The mlx-lm ``Model`` for ``args`` (from ``model_args``)."""
    return mlx_lm_module(args.model_type).Model(args)


# mlx-lm modules whose Model.__call__ is exactly ``self.model`` (the decoder) followed by
# the head (``lm_head``, or the embedding when tied): for them, logits for the last
# position alone skip the head's product over the others. Other modules get the full
# logits sliced (the same numbers, without the saving).
HEAD_AFTER_DECODER = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "ministral3",
                                "lfm2"})


class MlxLmDecoder:
    """The decoder side of the family contract (see models/base.py) for a model whose
    ``language_model`` is ``text_model(...)`` and whose ``args.max_context`` comes from
    ``max_context``. Mixed in ahead of ``VisionLanguageModel``:
    ``class Model(MlxLmDecoder, VisionLanguageModel)``. (``layers`` is the base
    class's: mlx-lm's models have it.)"""

    @property
    def max_context(self) -> int | None:
        return self.args.max_context

    def make_cache(self) -> list[Any]:
        # mlx-lm's own: rotating caches for sliding-window layers.
        if hasattr(self.language_model, "make_cache"):
            return self.language_model.make_cache()
        return super().make_cache()

    def __call__(self, input_ids, cache=None, *, embeddings=None, state=None, last_only=False):
        lm = self.language_model
        if not last_only or type(lm).__module__.rsplit(".", 1)[-1] not in HEAD_AFTER_DECODER:
            logits = lm(input_ids, cache=cache, input_embeddings=embeddings)
            return logits[:, -1:] if last_only else logits
        # The head on the last position alone: what these modules' Model.__call__ does to
        # every position (mlx-lm creates ``lm_head`` only when it is not tied).
        h = lm.model(input_ids, cache, embeddings)[:, -1:]
        return lm.lm_head(h) if "lm_head" in lm else lm.model.embed_tokens.as_linear(h)
