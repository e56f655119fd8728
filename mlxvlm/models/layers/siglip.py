"""The SigLIP vision encoder (Zhai et al., 2023): a ViT over fixed-size square patches with
learned absolute position embeddings, pre-norm encoder blocks and a final LayerNorm.

Shared by every family whose vision tower is SigLIP or a variant of it:

- Gemma 3, PaliGemma, LLaVA-OneVision: ``SiglipVisionModel`` (checkpoint names
  ``vision_tower.vision_model.*``), positions ``0 .. num_patches - 1``.
- Idefics3 / SmolVLM: ``SiglipVisionTransformer`` directly (names ``vision_model.*``) with a
  per-image ``patch_mask``: images smaller than the encoder's square are padded, padding
  patches are never attended to, and each real patch takes the position its fractional
  (row, column) falls in on the full grid (NaViT-style "Patch n' Pack" positions).

The attention-pooling head (``vision_use_head``) is not built: no vision-language model
uses the pooled output, only the patch features.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import run_ahead
from mlxvlm.models.feature_cache import cached_rows
from mlxvlm.models.layers.activations import activation
from mlxvlm.models.layers.vit import Encoder, VitConfig
from mlxvlm.models.config_utils import with_defaults

# transformers' SiglipVisionConfig defaults, for keys a checkpoint's config leaves out.
SIGLIP_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}


@dataclass(frozen=True)
class SiglipVisionConfig(VitConfig):
    @classmethod
    def from_hf(cls, vision: dict) -> "SiglipVisionConfig":
        """From a ``vision_config`` dict; missing keys take SigLIP's defaults."""
        values = with_defaults(vision, SIGLIP_DEFAULTS)
        activation(values["hidden_act"])  # refuses an unsupported one when the config is read
        return cls(**{f.name: values[f.name] for f in fields(cls)})


class VisionEmbeddings(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)

    def __call__(self, pixels: mx.array, position_ids: mx.array | None) -> mx.array:
        """``pixels``: (B, H, W, C); ``position_ids``: (B, patches) or None for 0, 1, ..."""
        patches = self.patch_embedding(pixels)  # (B, H/p, W/p, D), row-major like PyTorch
        patches = patches.reshape(patches.shape[0], -1, patches.shape[-1])
        if position_ids is None:
            position_ids = mx.arange(patches.shape[1])[None]
        return patches + self.position_embedding(position_ids)


class SiglipVisionTransformer(nn.Module):
    """Embeddings, encoder and post-LayerNorm (transformers' ``SiglipVisionTransformer``)."""

    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = VisionEmbeddings(config)
        self.encoder = Encoder(config)  # CLIP's blocks too (see layers/vit.py)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(
        self,
        pixels: mx.array,
        patch_mask: np.ndarray | None = None,
        output_hidden_states: bool = False,
    ):
        """Patch features of ``pixels`` (B, H, W, C), after the final LayerNorm.

        ``patch_mask`` (B, H/p, W/p) bool marks real (not padding) patches; with it,
        positions follow the NaViT fractional-coordinate scheme and padding patches are
        masked out of attention. With ``output_hidden_states`` also returns the hidden
        states as transformers numbers them: ``[0]`` the embeddings, ``[i]`` the output of
        encoder layer ``i`` (so ``[-1]`` is the last layer's, before the final LayerNorm).
        """
        position_ids = mask = None
        if patch_mask is not None:
            patch_mask = np.asarray(patch_mask, dtype=bool)
            position_ids = mx.array(navit_position_ids(patch_mask, self.config.patches_per_side))
            keys_valid = patch_mask.reshape(patch_mask.shape[0], 1, 1, -1)
            if not keys_valid.all():
                mask = mx.array(keys_valid)
        h = self.embeddings(pixels, position_ids)
        # Kept only when asked for: a reference keeps every layer's output alive until
        # the end of the (lazily evaluated) tower.
        hidden_states = [h] if output_hidden_states else None
        for layer in self.encoder.layers:
            h = layer(h, mask)
            run_ahead.layer_done(h)
            if output_hidden_states:
                hidden_states.append(h)
        out = self.post_layernorm(h)
        return (out, hidden_states) if output_hidden_states else out


class SiglipVisionModel(nn.Module):
    """The wrapper transformers' ``SiglipVisionModel`` adds (checkpoint names
    ``<tower>.vision_model.*``)."""

    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.vision_model = SiglipVisionTransformer(config)

    def __call__(self, pixels: mx.array, patch_mask=None, output_hidden_states: bool = False):
        return self.vision_model(pixels, patch_mask, output_hidden_states)


def navit_position_ids(patch_mask: np.ndarray, patches_per_side: int) -> np.ndarray:
    """Position ids (B, h*w) for the real patches of each image in ``patch_mask`` (B, h, w).

    A real patch at (row, column) of an image with ``rows x columns`` real patches takes
    the position of the cell that (row / rows, column / columns) falls in on the
    ``patches_per_side``-square grid the position embeddings were trained on; padding
    patches take position 0. The arithmetic is transformers' (float64 boundaries rounded to
    float32, float32 coordinates), so the buckets agree with it to the last bit.
    """
    B, h, w = patch_mask.shape
    n = patches_per_side
    step = 1.0 / n
    count = int(np.ceil((1.0 - step) / step))  # torch.arange(step, 1.0, step), in float64
    boundaries = (step + np.arange(count) * step).astype(np.float32)
    limit = np.float32(1.0 - 1e-6)
    ids = np.zeros((B, h * w), dtype=np.int32)
    for b in range(B):
        rows = max(int(patch_mask[b, :, 0].sum()), 1)
        columns = max(int(patch_mask[b, 0, :].sum()), 1)
        row_coords = np.arange(h, dtype=np.float32) * (np.float32(1.0) / np.float32(rows))
        column_coords = np.arange(w, dtype=np.float32) * (np.float32(1.0) / np.float32(columns))
        row_bucket = np.searchsorted(boundaries, np.minimum(row_coords, limit), side="right")
        column_bucket = np.searchsorted(boundaries, np.minimum(column_coords, limit), side="right")
        grid = row_bucket[:, None] * n + column_bucket[None, :]
        ids[b] = np.where(patch_mask[b].reshape(-1), grid.reshape(-1), 0)
    return ids


def convert_hf_weight(name: str, value: mx.array) -> mx.array | None:
    """A SigLIP tensor of a PyTorch checkpoint (``name`` relative to the encoder, e.g.
    ``embeddings.patch_embedding.weight``) in this module's layout; None for tensors this
    port does not use (position-id buffers, the attention-pooling head)."""
    if name.endswith("position_ids") or name.startswith("head."):
        return None
    if name == "embeddings.patch_embedding.weight":
        return value.transpose(0, 2, 3, 1)  # PyTorch Conv2d (O, I, kh, kw) -> MLX (O, kh, kw, I)
    return value


def projected_image_features(model, pixel_values, dtype: mx.Dtype) -> mx.array:
    """(images, tokens, text width): each of the processor's (images, C, H, W) images
    through ``model.vision_tower`` (a ``SiglipVisionModel``) in ``dtype``, then
    ``model.multi_modal_projector``. SigLIP sees each image on its own, so images seen
    before come from the model's feature cache."""
    pixels = mx.array(pixel_values) if not isinstance(pixel_values, mx.array) else pixel_values

    def encode(images: mx.array) -> mx.array:
        patches = model.vision_tower(images.transpose(0, 2, 3, 1).astype(dtype))
        return model.multi_modal_projector(patches)

    return cached_rows(model, "image", encode, pixels)
