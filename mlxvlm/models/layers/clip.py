"""The CLIP vision transformer (Radford et al., 2021), as the LLaVA family uses it.

Images are cut into ``patch_size`` squares by a strided convolution, a learned class
token is prepended, learned absolute position embeddings are added, and pre-norm
transformer blocks follow. Vision-language models read the hidden states of one or more
blocks (not the pooled class token), so ``hidden_states`` returns those and runs only
the blocks it needs.

Module names follow the checkpoints mlx-community publishes:
``vision_model.embeddings.{class_embedding,patch_embedding,position_embedding}``,
``vision_model.pre_layrnorm`` (sic), ``vision_model.encoder.layers.N.*``,
``vision_model.post_layernorm``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.models import run_ahead
from mlxvlm.models.layers.vit import Encoder, VitConfig


@dataclass(frozen=True)
class CLIPVisionConfig(VitConfig):
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @classmethod
    def from_hf(cls, vision: dict) -> "CLIPVisionConfig":
        """From a complete ``clip_vision_model`` config (see config_utils): its values
        of this class's fields, by the same names."""
        return cls(**{f.name: vision[f.name] for f in fields(cls) if f.name in vision})



class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.config = config
        self.class_embedding = mx.zeros((config.hidden_size,))
        # Weight in MLX's channels-last layout: (out, kh, kw, in).
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size,
            stride=config.patch_size, bias=False,
        )
        self.position_embedding = nn.Embedding(config.patches_per_side**2 + 1, config.hidden_size)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        """(B, H, W, C) channels-last pixels -> (B, 1 + patches, hidden)."""
        batch, height, width, _ = pixel_values.shape
        size = self.config.image_size
        if (height, width) != (size, size):
            raise ValueError(
                f"the CLIP tower takes {size}x{size} images but got {height}x{width}; "
                "use the checkpoint's own image processor"
            )
        patches = self.patch_embedding(pixel_values.astype(self.patch_embedding.weight.dtype))
        patches = patches.reshape(batch, -1, patches.shape[-1])
        cls = mx.broadcast_to(self.class_embedding, (batch, 1, patches.shape[-1]))
        embeddings = mx.concatenate([cls.astype(patches.dtype), patches], axis=1)
        # Looked up rather than read as `.weight`, which a quantized embedding packs.
        return embeddings + self.position_embedding(mx.arange(embeddings.shape[1]))


class CLIPVisionTransformer(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = Encoder(config)  # SigLIP's blocks too (see layers/vit.py)
        # Only the pooled class token passes through it; kept so checkpoints load whole.
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


def convert_hf_weight(name: str, value: mx.array) -> mx.array | None:
    """A CLIP tensor of a PyTorch checkpoint (``name`` relative to the tower, e.g.
    ``embeddings.patch_embedding.weight``) in this module's layout; None for buffers that
    are recomputed here."""
    if name.endswith("position_ids"):
        return None
    if name == "embeddings.patch_embedding.weight":
        return value.transpose(0, 2, 3, 1)  # PyTorch Conv2d (O, I, kh, kw) -> MLX (O, kh, kw, I)
    return value


class CLIPVisionModel(nn.Module):
    """``vision_model`` wrapped once more, as the checkpoints name it."""

    # The tower prepends a class token to the patch tokens.
    has_class_token = True
    convert_hf_weight = staticmethod(convert_hf_weight)

    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.config = config
        self.vision_model = CLIPVisionTransformer(config)

    def hidden_states(self, pixel_values: mx.array, layers: Sequence[int]) -> list[mx.array]:
        """Hidden states at ``layers`` as transformers indexes ``hidden_states``: 0 is the
        (pre-normed) embedding output, ``i`` the output of block ``i``, negatives count
        from the end. Blocks after the last one asked for are not run."""
        count = len(self.vision_model.encoder.layers) + 1
        for layer in layers:
            if not -count <= layer < count:
                raise ValueError(f"vision feature layer {layer} is out of range for {count} states")
        wanted = [layer % count for layer in layers]
        x = self.vision_model.pre_layrnorm(self.vision_model.embeddings(pixel_values))
        states = [x]
        for block in self.vision_model.encoder.layers[: max(wanted)]:
            x = block(x)
            run_ahead.layer_done(x)
            states.append(x)
        return [states[i] for i in wanted]
