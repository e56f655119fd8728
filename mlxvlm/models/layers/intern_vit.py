"""InternViT (Chen et al., 2024), the vision tower of InternVL as transformers 5 writes it
(``InternVLVisionModel``).

A square tile is cut into ``patch_size`` squares by a strided convolution, a learned
class token is prepended and learned absolute position embeddings are added. Each block
is pre-norm (LayerNorm or RMSNorm, by ``norm_type``) with *layer scale*: the attention's
and the MLP's outputs are multiplied by learned per-channel vectors (``lambda_1``,
``lambda_2``) before their residual additions. Some sizes normalize the queries and keys
over the whole width (``use_qk_norm``: one RMSNorm across all heads, not per head).

Module names follow transformers' (and so the checkpoints mlx-community converts from
them): ``embeddings.{cls_token,position_embeddings,patch_embeddings.projection}``,
``encoder.layer.N.attention.{q,k,v}_proj``, ``.projection_layer``, ``.q_norm``,
``.k_norm``, ``encoder.layer.N.{layernorm_before,layernorm_after,lambda_1,lambda_2}``,
``encoder.layer.N.mlp.{fc1,fc2}`` and ``layernorm`` (only without mean pooling).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.cpu.ops import scaled_dot_product_attention
from mlxvlm.models import run_ahead
from mlxvlm.models.config_utils import with_defaults
from mlxvlm.models.layers.activations import activation
from mlxvlm.models.layers.vit import MLP

# transformers' InternVLVisionConfig defaults, for the fields this tower reads.
DEFAULTS = dict(
    hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, attention_bias=False,
    use_qk_norm=False, intermediate_size=4096, hidden_act="gelu", norm_type="layer_norm",
    layer_norm_eps=1e-6, image_size=448, patch_size=14, num_channels=3,
    use_absolute_position_embeddings=True, use_mean_pooling=True,
)
NORM_TYPES = ("layer_norm", "rms_norm")
# transformers' InternVLVisionRMSNorm default: the q/k norms do not take layer_norm_eps.
QK_NORM_EPS = 1e-6


def _side(value) -> int:
    """A square size from an int or an (h, w) pair; InternViT takes square tiles only."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise NotImplementedError(f"InternViT with non-square size {list(value)}")
        return int(value[0])
    return int(value)


@dataclass(frozen=True)
class InternVisionConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    attention_bias: bool
    use_qk_norm: bool
    intermediate_size: int
    hidden_act: str
    norm_type: str
    layer_norm_eps: float
    image_size: int
    patch_size: int
    num_channels: int
    use_absolute_position_embeddings: bool
    use_mean_pooling: bool

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, vision: dict) -> "InternVisionConfig":
        values = with_defaults(vision, DEFAULTS)
        values["image_size"] = _side(values["image_size"])
        values["patch_size"] = _side(values["patch_size"])
        if values["norm_type"] not in NORM_TYPES:
            raise NotImplementedError(
                f"InternViT norm_type {values['norm_type']!r} (supported: {NORM_TYPES})"
            )
        activation(values["hidden_act"])  # refuses an unsupported one now
        return cls(**values)


def _norm(config: InternVisionConfig) -> nn.Module:
    if config.norm_type == "rms_norm":
        return nn.RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class PatchEmbeddings(nn.Module):
    def __init__(self, config: InternVisionConfig):
        super().__init__()
        # Weight in MLX's channels-last layout: (out, kh, kw, in).
        self.projection = nn.Conv2d(config.num_channels, config.hidden_size,
                                    config.patch_size, stride=config.patch_size)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        patches = self.projection(pixel_values.astype(self.projection.weight.dtype))
        return patches.reshape(patches.shape[0], -1, patches.shape[-1])


class Embeddings(nn.Module):
    def __init__(self, config: InternVisionConfig):
        super().__init__()
        self.config = config
        self.cls_token = mx.zeros((1, 1, config.hidden_size))
        self.patch_embeddings = PatchEmbeddings(config)
        if config.use_absolute_position_embeddings:
            self.position_embeddings = mx.zeros(
                (1, config.patches_per_side**2 + 1, config.hidden_size)
            )

    def __call__(self, pixel_values: mx.array) -> mx.array:
        """(B, H, W, C) channels-last tiles -> (B, 1 + patches, hidden)."""
        batch, height, width, _ = pixel_values.shape
        size = self.config.image_size
        if (height, width) != (size, size):
            # transformers would resample the position table bicubically; the image
            # processor's tiles are the tower's size in every released checkpoint.
            raise ValueError(
                f"the InternViT tower takes {size}x{size} tiles but got {height}x{width}; "
                "use the checkpoint's own image processor"
            )
        patches = self.patch_embeddings(pixel_values)
        cls = mx.broadcast_to(self.cls_token, (batch, 1, patches.shape[-1])).astype(patches.dtype)
        embeddings = mx.concatenate([cls, patches], axis=1)
        if "position_embeddings" in self:
            embeddings = embeddings + self.position_embeddings.astype(patches.dtype)
        return embeddings


class Attention(nn.Module):
    def __init__(self, config: InternVisionConfig):
        super().__init__()
        dims = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.scale = (dims // self.num_heads) ** -0.5
        self.q_proj = nn.Linear(dims, dims, bias=config.attention_bias)
        self.k_proj = nn.Linear(dims, dims, bias=config.attention_bias)
        self.v_proj = nn.Linear(dims, dims, bias=config.attention_bias)
        self.projection_layer = nn.Linear(dims, dims)
        if config.use_qk_norm:
            self.q_norm = nn.RMSNorm(dims, eps=QK_NORM_EPS)
            self.k_norm = nn.RMSNorm(dims, eps=QK_NORM_EPS)

    def __call__(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if "q_norm" in self:  # across all heads at once
            q, k = self.q_norm(q), self.k_norm(k)

        def heads(t: mx.array) -> mx.array:
            return t.reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)

        out = scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=self.scale)
        return self.projection_layer(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Layer(nn.Module):
    def __init__(self, config: InternVisionConfig):
        super().__init__()
        self.attention = Attention(config)
        self.mlp = MLP(config)
        self.layernorm_before = _norm(config)
        self.layernorm_after = _norm(config)
        self.lambda_1 = mx.ones((config.hidden_size,))
        self.lambda_2 = mx.ones((config.hidden_size,))

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        run_ahead.layer_done(x)
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class Encoder(nn.Module):
    def __init__(self, config: InternVisionConfig):
        super().__init__()
        self.layer = [Layer(config) for _ in range(config.num_hidden_layers)]


class InternVisionModel(nn.Module):
    # The tower prepends a class token to the patch tokens.
    has_class_token = True

    def __init__(self, config: InternVisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        if not config.use_mean_pooling:
            self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def hidden_state(self, pixel_values: mx.array, layer: int) -> mx.array:
        """The hidden state InternVL reads at ``vision_feature_layer`` ``layer``: -1 is the
        last block's output through the final norm (``last_hidden_state``); any other
        index counts as transformers' ``hidden_states`` do (0: the embeddings, ``i``: block
        ``i``'s output, negatives from the end). Blocks after it are not run."""
        blocks = self.encoder.layer
        count = len(blocks) + 1
        if not -count <= layer < count:
            raise ValueError(f"vision feature layer {layer} is out of range for {count} states")
        wanted = len(blocks) if layer == -1 else layer % count
        x = self.embeddings(pixel_values)
        for block in blocks[:wanted]:
            x = block(x)
            run_ahead.layer_done(x)
        if layer == -1 and "layernorm" in self:
            x = self.layernorm(x)
        return x


def convert_hf_weight(name: str, value: mx.array) -> mx.array | None:
    """An InternViT tensor of a PyTorch checkpoint (``name`` relative to the tower) in
    this module's layout."""
    if name == "embeddings.patch_embeddings.projection.weight":
        return value.transpose(0, 2, 3, 1)  # PyTorch Conv2d (O, I, kh, kw) -> MLX (O, kh, kw, I)
    return value
