"""GLM-OCR (``glm_ocr``; Z.ai, 2026): a 0.9B document reader built as GLM-4.6V-Flash is
(``glm4v.py``: native-resolution patches in place of the prompt's ``<|image|>`` runs,
the GLM-V tower, GLM-4's decoder under M-RoPE), with other settings of the same layers:

- the tower (``layers/glm_vision.py``) without the learned position table and its norm,
  with biases on every attention and MLP projection, per-head RMSNorm on queries and
  keys, its block MLP ``intermediate_size`` wide and its projector ``out_hidden_size *
  in_channels`` wide;
- the decoder (``layers/glm_decoder.py``): the dense one, no attention biases, heads of
  the config's ``head_dim`` (128 over a 1536 width), the whole head turned in pairs.

The checkpoint's multi-token-prediction layer (``layers.16.*``, ``num_nextn_predict_layers``)
is left out at load, as transformers ignores it. The processor is GLM-4.6V's
(``Glm46VProcessor``, which the Hub's preprocessor_config.json names). The documented
task prompts ("Text Recognition:", "Formula Recognition:", "Table Recognition:", or a
JSON schema to fill) are plain user text after the image.

Defaults for keys a config leaves out are transformers' GlmOcrConfig's, not GLM-4.6V's.
"""

from __future__ import annotations

from mlxvlm.models import glm4v
from mlxvlm.models.config_utils import token_id, vision_config
from mlxvlm.models.layers.glm_decoder import GlmTextConfig
from mlxvlm.models.layers.glm_vision import GlmVisionConfig

# transformers' GlmOcrVisionConfig / GlmOcrTextConfig defaults where they differ from
# GLM-4.6V's (transformers' save_pretrained leaves default values out of config.json)
VISION_DEFAULTS = {"hidden_size": 1024, "num_heads": 16, "out_hidden_size": 1536,
                   "intermediate_size": 4096, "attention_bias": True}
TEXT_DEFAULTS = {"vocab_size": 59392, "hidden_size": 1024, "intermediate_size": 4096,
                 "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
                 "max_position_embeddings": 131072}
# GlmOcrConfig's token ids
TOKEN_DEFAULTS = {"image_token": 59280, "video_token": 59281,
                  "video_start_token": 59258, "video_end_token": 59259}


def model_args(config: dict) -> glm4v.ModelArgs:
    """transformers' GlmOcrConfig -> the GLM-V model's arguments with GLM-OCR's switches."""
    vision = {**VISION_DEFAULTS, **vision_config(config)}
    text = {**TEXT_DEFAULTS, **(config.get("text_config") or {})}
    filled = {**config, "vision_config": vision, "text_config": text}
    return glm4v.ModelArgs(
        text=GlmTextConfig.from_hf(
            filled, moe=False, attention_bias=False,
            # GlmOcrTextAttention: the config's head_dim, else hidden_size / heads
            explicit_head_dim=text.get("head_dim"),
        ),
        vision=GlmVisionConfig.from_hf(
            vision, learned_positions=False, qk_norm=True, projection_biases=True,
            mlp_width=vision["intermediate_size"],
            merger_width=vision["out_hidden_size"] * vision.get("in_channels", 3),
        ),
        **{f"{name}_id": token_id(config, name, default) for name, default in TOKEN_DEFAULTS.items()},
    )


class Model(glm4v.Model):
    @classmethod
    def from_config(cls, config: dict) -> "Model":
        return cls(model_args(config))


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
