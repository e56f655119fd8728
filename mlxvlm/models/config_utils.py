"""Read a checkpoint's ``config.json`` whichever of its two layouts it was written in.

The same model ships with two config layouts:

- the Hub's older one (what real downloads and mlx-community's conversions carry): the
  text model's parameters at the top level, ``rope_theta`` beside them, ``rope_scaling``
  such as ``{"type": "mrope", "mrope_section": [16, 24, 24]}``, and a ``vision_config``
  whose ``model_type`` is the family's own (``"qwen2_vl"``);
- transformers 5's ``save_pretrained`` one: a ``text_config`` sub-dict carrying
  ``rope_parameters`` (``{"rope_type": "default", "rope_theta": ..., ...}``) and renamed
  sub-config types (``"qwen2_vl_text"``, ``"qwen2_vl_vision"``).

Families read their configs only through these helpers, so a loader can never pick a
default rope θ because the real one sat under the other layout's key.
"""

from __future__ import annotations

from typing import Any

# Sub-configs of a multimodal checkpoint; everything else at the top level is either a
# text-model parameter (old layout) or a multimodal one (token ids, tie_word_embeddings).
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config")


# The decoder sizes that transformers' text configs and mlx-lm's ModelArgs name alike.
DECODER_SIZES = (
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
)


def with_defaults(config: dict, defaults: dict) -> dict:
    """``defaults`` (a tower's fields and transformers' default values) overridden by the
    values ``config`` gives for them; the config's other keys left out."""
    return {**defaults, **{k: v for k, v in config.items() if k in defaults}}


def decoder_sizes(text: dict) -> dict:
    """``text``'s ``DECODER_SIZES``, as keyword arguments of an mlx-lm ``ModelArgs``."""
    return {name: text[name] for name in DECODER_SIZES}


def text_config(config: dict, default_rope_theta: float) -> dict:
    """The text model's parameters as one flat dict, in either layout.

    Top-level values (old layout) are overridden by ``text_config`` (new layout).
    ``rope_parameters`` is always present and standardized (see ``rope_parameters``), and
    ``tie_word_embeddings`` is resolved the way transformers resolves it.
    """
    text = {k: v for k, v in config.items() if k not in _SUB_CONFIGS}
    text.update(config.get("text_config") or {})
    text["rope_parameters"] = rope_parameters(text, default_rope_theta)
    text["tie_word_embeddings"] = tie_word_embeddings(config)
    return text


def rope_parameters(text: dict, default_rope_theta: float) -> dict:
    """``{"rope_type": ..., "rope_theta": ..., <type-specific keys>}`` from either layout.

    ``rope_parameters`` (new) wins over ``rope_scaling`` (old); θ comes from inside it,
    else from a top-level ``rope_theta``, else the family's default. The old ``"type":
    "mrope"`` is not a frequency scaling but the plain rope applied per section, which
    transformers 5 calls ``"default"``.
    """
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        # transformers 5 keys rope parameters by layer type when the types differ.
        return {
            layer_type: rope_parameters({**text, "rope_parameters": sub}, default_rope_theta)
            for layer_type, sub in params.items()
        }
    if "rope_theta" not in params:
        params["rope_theta"] = text.get("rope_theta", default_rope_theta)
    params["rope_theta"] = float(params["rope_theta"])
    legacy_type = params.pop("type", None)
    rope_type = params.get("rope_type") or legacy_type or "default"
    params["rope_type"] = "default" if rope_type == "mrope" else rope_type
    return params


def tie_word_embeddings(config: dict) -> bool:
    """The top level's value when it has one (transformers 5 writes it there, and may
    leave a contradicting default in text_config), else text_config's (older checkpoints)."""
    if config.get("tie_word_embeddings") is not None:
        return bool(config["tie_word_embeddings"])
    text = config.get("text_config") or {}
    return bool(text.get("tie_word_embeddings"))


def vision_config(config: dict) -> dict:
    """The vision tower's parameters with the old key spellings mapped to the new ones."""
    vision = dict(config.get("vision_config") or {})
    if "in_channels" not in vision and "in_chans" in vision:
        vision["in_channels"] = vision["in_chans"]
    return vision


def token_id(config: dict, name: str, default: int | None = None) -> Any:
    """``image_token_id`` and friends; some conversions spell them ``*_token_index``."""
    for key in (f"{name}_id", f"{name}_index"):
        if config.get(key) is not None:
            return config[key]
    return default


def as_transformers_reads_it(config: dict) -> dict:
    """``config`` completed the way transformers reads it: sub-configs filled with their
    class defaults, ``rope_parameters`` standardized, ``tie_word_embeddings`` resolved.

    The Hub's older composite checkpoints (LLaVA and friends) store sub-configs as
    transformers' ``to_diff_dict`` wrote them: only the values that differ from the
    sub-model's defaults (``text_config`` of llava-1.5 holds no ``hidden_size``). Their
    defaults live in transformers' config classes, so the config goes through the
    family's own class, whose sub-configs resolve by their ``model_type``. Keys that
    transformers does not know (``quantization``, ``mlxvlm_format``) are kept.
    """
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[config["model_type"]](**config).to_dict()
