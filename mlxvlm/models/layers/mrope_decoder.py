"""The Qwen2 / Qwen3 text decoder with multimodal rotary position embedding (M-RoPE).

M-RoPE gives every token three position ids (temporal, height, width) and rotates each
section of the head dimension (``mrope_section``, in rotary frequency pairs) by one of
them. Text tokens carry the same id on all three axes, so for pure text M-RoPE is plain
RoPE; vision tokens carry their grid coordinates. No mlx-lm model takes per-token
position ids, so this decoder is written here.

Qwen3-VL's decoder is the same loop with a few switches in ``TextConfig``: per-head
RMSNorm on queries and keys, an explicit head size, interleaved M-RoPE sections
(``mrope_interleaved``: frequencies cycle t, h, w instead of coming in three blocks), an
optional sparse-MoE MLP (mlx-lm's ``Qwen3MoeSparseMoeBlock``), and DeepStack: vision
features added to the hidden states of the image tokens after each of the first layers
(``DeepstackFeatures`` in the request state).

Qwen2.5-Omni's TMRoPE uses the same decoder with time-aligned positions: a video's
temporal ids count ``position_id_per_seconds`` per second, text resumes after a block's
largest id (``text_after="max"``), and a video with its sound track interleaves the two
in time chunks (``AudioVideoSpan``).

Positions are absolute: the decoder reads its offset from ``cache[0].offset`` and takes the
position ids of the tokens at ``[offset, offset + n)`` from the request's ``MRopeState``
(the prompt's ids while prefilling, ``offset + rope_delta`` on all axes after the prompt).
That keeps chunked prefill of any chunk size, rotating caches (whose ``offset`` counts
every token seen) and quantized caches correct.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock

from mlxvlm.models.config_utils import text_config
from mlxvlm.cpu.ops import cached_attention, gated, silu
from mlxvlm.models.layers.blocks import TextDecoder
from mlxvlm.models.layers.rotary import apply_rotary


swiglu = gated(silu)


def default_mrope(text: dict, family: str) -> dict:
    """The text config's rope parameters, refused unless they are the default rope that
    M-RoPE applies per section (as in every released ``family`` model)."""
    rope = text["rope_parameters"]
    if rope.get("rope_type") != "default":
        raise NotImplementedError(
            f"rope type {rope.get('rope_type')!r} is not supported with M-RoPE (only the "
            f"default rope per section, as in every released {family} model)"
        )
    return rope


@dataclass
class TextConfig:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = True
    # Qwen3-VL switches (defaults: Qwen2-VL).
    explicit_head_dim: int | None = None  # None: hidden_size / num_attention_heads
    qk_norm: bool = False  # RMSNorm over each head of the queries and keys
    o_proj_bias: bool = False
    mlp_bias: bool = False  # ERNIE-4.5 (PaddleOCR-VL): one use_bias for every projection
    mrope_interleaved: bool = False
    # Sparse MoE MLP (Qwen3-VL-MoE); num_experts 0: dense MLP everywhere.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, index: int) -> bool:
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, config: dict, default_rope_theta: float = 1_000_000.0) -> "TextConfig":
        """From a checkpoint's config.json, in either layout (see config_utils)."""
        text = text_config(config, default_rope_theta)
        rope = default_mrope(text, "Qwen-VL")
        if text.get("use_sliding_window"):
            raise NotImplementedError(
                "use_sliding_window=true is not supported for the Qwen-VL text decoder"
            )
        heads = text["num_attention_heads"]
        # Defaults where a key is missing are transformers' Qwen2VLTextConfig defaults.
        return cls(
            hidden_size=text["hidden_size"],
            num_hidden_layers=text["num_hidden_layers"],
            intermediate_size=text["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=text.get("num_key_value_heads", 8) or heads,
            vocab_size=text["vocab_size"],
            rms_norm_eps=text.get("rms_norm_eps", 1e-5),
            rope_theta=rope["rope_theta"],
            mrope_section=tuple(rope["mrope_section"]),
            max_position_embeddings=text.get("max_position_embeddings", 32768),
            tie_word_embeddings=text["tie_word_embeddings"],
            # Qwen2 always has q/k/v biases; the key exists only in some fine-tunes' configs.
            attention_bias=text.get("attention_bias", True),
        )


@dataclass
class DeepstackFeatures:
    """Vision features added to the image/video tokens' hidden states after the first
    ``len(layers)`` decoder layers (DeepStack, Qwen3-VL).

    ``positions`` are the prompt indices of the vision tokens (ascending) and
    ``layers[i]`` holds one row per position. Any prefill chunk takes the rows of the
    positions it covers, so chunked prefill injects exactly what one pass would.
    """

    positions: np.ndarray  # (V,) int
    layers: list[mx.array]  # each (V, hidden_size)

    def window(self, offset: int, n: int) -> tuple[tuple, list[mx.array]] | None:
        """For cache offsets [offset, offset + n): the index of the chunk's vision rows in
        its (1, n, width) hidden states, and their per-layer rows (a padded batch's state
        gives (row, column) indices of its own, ``retrieval.qwen3_vl_batch``)."""
        first, last = np.searchsorted(self.positions, [offset, offset + n])
        if first == last:
            return None
        local = mx.array(self.positions[first:last] - offset)
        return (slice(None), local), [features[first:last] for features in self.layers]


@dataclass
class MRopeState:
    """Per-request positions: the prompt's M-RoPE ids and how far text after it is shifted.

    ``rope_delta`` is (the last prompt token's position + 1) - prompt length: a vision
    grid of h x w tokens advances the positions by only max(h, w), so every token after
    the prompt sits ``rope_delta`` away from its cache offset. (The last token's, not the
    largest: transformers' generation continues from the last token, and a long video's
    temporal positions can pass the text's after it.)
    """

    # (3, prompt_length) int32; float32 where a family places frames between integers
    # (Qwen3-Omni's TMRoPE), and then rope_delta may be a float too
    position_ids: mx.array
    rope_delta: int | float
    deepstack: DeepstackFeatures | None = None

    def positions(self, offset: int, n: int) -> mx.array:
        """The (3, n) position ids of the tokens at cache offsets ``[offset, offset + n)``."""
        prompt_length = self.position_ids.shape[1]
        parts = []
        if offset < prompt_length:
            parts.append(self.position_ids[:, offset : min(offset + n, prompt_length)])
        start = max(offset, prompt_length)
        if offset + n > start:
            after = mx.arange(start, offset + n, dtype=mx.int32) + self.rope_delta
            parts.append(mx.broadcast_to(after, (3, after.shape[0])))
        if len(parts) == 1:
            return parts[0]
        if parts[0].dtype != parts[1].dtype:
            parts = [part.astype(mx.float32) for part in parts]
        return mx.concatenate(parts, axis=1)

    def prefix(self, length: int) -> "MRopeState":
        """The state of a prompt that shares this one's first ``length`` tokens and goes on
        with text only (prompt-cache reuse): its text continues after the position of the
        last of those tokens."""
        if length >= self.position_ids.shape[1]:
            return MRopeState(self.position_ids, self.rope_delta)
        ids = self.position_ids[:, :length]
        return MRopeState(ids, continuation_delta(ids))

    @staticmethod
    def batch(states: Sequence["MRopeState | None"]) -> "MRopeBatchState":
        """The decode-time state of requests batched one per row (None: plain text)."""
        deltas = [0 if s is None else s.rope_delta for s in states]
        fractional = any(isinstance(d, float) for d in deltas)
        return MRopeBatchState(mx.array(deltas, dtype=mx.float32 if fractional else mx.int32))


@dataclass
class MRopeBatchState:
    """Positions while decoding a batch, one request per row: after its prompt, a row's
    next token sits at its own cache offset plus its own ``rope_delta``."""

    rope_deltas: mx.array  # (B,) int32 (float32 where some are fractional)
    deepstack = None  # vision features only enter during a request's own prefill

    def positions(self, offset: mx.array, n: int) -> mx.array:
        """The (B, 3, n) position ids of each row's tokens at ``[offset[b], offset[b] + n)``."""
        rows = offset[:, None] + mx.arange(n, dtype=mx.int32) + self.rope_deltas[:, None]
        return mx.broadcast_to(rows[:, None, :], (rows.shape[0], 3, n))


def text_positions(offset: int, n: int) -> mx.array:
    """Positions of plain text (no state): the cache offset on all three axes."""
    return mx.broadcast_to(mx.arange(offset, offset + n, dtype=mx.int32), (3, n))


@dataclass
class VisionSpan:
    """One image or video in the prompt, as the M-RoPE index sees it."""

    grid_thw: tuple[int, int, int]  # in patches, as the processor reports it
    time_interval: float = 1.0  # temporal position step per grid frame (videos)
    # Temporal position of each grid frame, when the family computes it itself
    # (Qwen2.5-Omni's TMRoPE: seconds x position_id_per_seconds); None: i * time_interval.
    # Fractional ones (Qwen3-Omni keeps seconds x 13 untruncated) make the block float32.
    frame_positions: Sequence[float] | None = None

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.grid_thw
        return t * (h // merge) * (w // merge)

    def position_ids(self, merge: int, start: int) -> np.ndarray:
        """(3, tokens): temporal, row and column of every merged token, from ``start``."""
        t, h, w = self.grid_thw
        if self.frame_positions is not None:
            temporal = np.asarray(self.frame_positions)
            if not is_whole(temporal):  # added in float32, as the reference does
                grids = np.meshgrid(temporal.astype(np.float32), np.arange(h // merge),
                                    np.arange(w // merge), indexing="ij")
                block = np.stack(grids).reshape(3, -1).astype(np.float32) + np.float32(start)
                return block.astype(np.float64)
            temporal = temporal.astype(np.int64)
        else:
            # float32 like the reference, so that truncation lands on the same integers
            temporal = (np.arange(t, dtype=np.float32) * np.float32(self.time_interval)).astype(np.int64)
        grid_t, grid_h, grid_w = np.meshgrid(temporal, np.arange(h // merge),
                                             np.arange(w // merge), indexing="ij")
        return np.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + start

    def write(self, positions: np.ndarray, ids: np.ndarray, index: int, start: int,
              merge: int, text_after: str) -> tuple[int, int]:
        """Write this item's ids at ``index``; returns the next index and text position."""
        n = self.num_tokens(merge)
        token = ids[index]
        if index + n > ids.shape[0] or (ids[index : index + n] != token).any():
            raise ValueError(
                f"a run of placeholder tokens {token} at {index} does not match the grid "
                f"{tuple(self.grid_thw)} given for it ({n} tokens)"
            )
        block = self.position_ids(merge, start)
        positions[:, index : index + n] = block
        if text_after == "max":  # Qwen2.5-Omni: after the largest id of the block
            return index + n, whole(block.max().item() + 1)
        _, h, w = self.grid_thw  # Qwen-VL: text continues max(h, w) after the start
        return index + n, start + max(h, w) // merge


def is_whole(values) -> bool:
    return bool(np.all(np.asarray(values) == np.round(values)))


def whole(value: float) -> int | float:
    """A position as an int where it is one (every family but Qwen3-Omni's videos)."""
    return int(value) if is_whole(value) else float(value)


def time_chunks(values: np.ndarray, tokens_per_chunk: int) -> list[tuple[int, int]]:
    """Split monotonic time positions into chunks ``[start, end)`` of ``values``: a new
    chunk begins at the first value at or past the next multiple of ``tokens_per_chunk``
    (one chunk per crossing, as transformers' ``get_chunked_index`` walks them)."""
    chunks, first, boundary = [], 0, tokens_per_chunk
    for i, value in enumerate(values.tolist()):
        if value >= boundary:
            chunks.append((first, i))
            first = i
            boundary += tokens_per_chunk
    chunks.append((first, len(values)))
    return chunks


@dataclass
class AudioVideoSpan:
    """A video with its sound track, interleaved in time (Qwen2.5-Omni's TMRoPE).

    In the prompt: ``<vision_bos><audio_bos>`` (one shared position), then for every
    ``tokens_per_chunk`` span of time the video's tokens of that span and then the audio's,
    then ``<audio_eos><vision_eos>`` (one shared position, after the last chunk's largest
    id). Video tokens carry (time, row, column) like any video; audio tokens carry their
    time (one position per token) on all three axes, so sound and frames of the same
    moment sit at the same temporal position. Keyed, like plain videos, by the video
    token; ``write`` starts at the first video token.
    """

    video: VisionSpan
    audio_tokens: int
    tokens_per_chunk: int
    video_token: int
    audio_token: int

    def write(self, positions: np.ndarray, ids: np.ndarray, index: int, start: int,
              merge: int, text_after: str) -> tuple[int, int]:
        if index < 2:
            raise ValueError("an audio-video block must open with two start tokens")
        # The two start tokens share the first one's position.
        positions[:, index - 1] = positions[:, index - 2]
        start = int(positions[0, index - 2]) + 1
        video = self.video.position_ids(merge, start)
        audio = np.broadcast_to(np.arange(self.audio_tokens) + start, (3, self.audio_tokens))
        video_chunks = time_chunks(video[0] - start, self.tokens_per_chunk)
        audio_chunks = time_chunks(audio[0] - start, self.tokens_per_chunk)
        at = index
        last = None
        for j in range(max(len(video_chunks), len(audio_chunks))):
            for chunks, block, token in ((video_chunks, video, self.video_token),
                                         (audio_chunks, audio, self.audio_token)):
                if j >= len(chunks):
                    continue
                first, end = chunks[j]
                n = end - first
                if at + n > ids.shape[0] or (ids[at : at + n] != token).any():
                    raise ValueError(
                        f"the audio-video block at {index} does not interleave as its grid "
                        f"{tuple(self.video.grid_thw)} and {self.audio_tokens} audio tokens say"
                    )
                last = block[:, first:end]
                positions[:, at : at + n] = last
                at += n
        if at + 2 > ids.shape[0]:
            raise ValueError(f"the audio-video block at {index} has no two end tokens")
        # The two end tokens share one position, after the last chunk's largest id.
        end_position = int(last.max()) + 1
        positions[:, at : at + 2] = end_position
        return at + 2, end_position + 1


def mrope_position_ids(
    input_ids: np.ndarray,
    spans: dict[int, Sequence[Any]],
    spatial_merge_size: int,
    *,
    text_after: str = "grid",
) -> tuple[np.ndarray, int]:
    """The prompt's (3, L) M-RoPE position ids and its rope delta.

    ``spans`` maps each placeholder token id (image pad, video pad) to its items in prompt
    order: ``VisionSpan`` or ``AudioVideoSpan``. Text advances all three axes by one per
    token. A vision item of t x h x w merged tokens placed at position p gets temporal ids
    p + floor(i * time_interval), height ids p + row and width ids p + column; the text
    after it continues at p + max(h, w) (``text_after="grid"``, transformers' Qwen-VL
    ``get_rope_index``) or after the item's largest id (``"max"``, Qwen2.5-Omni).
    """
    input_ids = np.asarray(input_ids).reshape(-1)
    pending = {token: list(items) for token, items in spans.items()}
    positions = np.zeros((3, input_ids.shape[0]), dtype=np.float64)
    index, position = 0, 0
    while index < input_ids.shape[0]:
        token = int(input_ids[index])
        if token not in pending:
            positions[:, index] = position
            index, position = index + 1, position + 1
            continue
        if not pending[token]:
            raise ValueError(
                f"the prompt has more placeholder tokens {token} than the features "
                "describe (image/video grids)"
            )
        item = pending[token].pop(0)
        index, position = item.write(positions, input_ids, index, position,
                                     spatial_merge_size, text_after)
    leftover = {token: len(items) for token, items in pending.items() if items}
    if leftover:
        raise ValueError(
            f"features were given for more images/videos than the prompt has placeholders "
            f"for (left over per placeholder token: {leftover})"
        )
    dtype = np.int32 if is_whole(positions) else np.float32
    return positions.astype(dtype), continuation_delta(positions)


def continuation_delta(positions) -> int | float:
    """How far text after a prompt with these (3, L) position ids sits from its cache
    offsets: it continues after the last token's position, as transformers' generation
    does (``position_ids[..., -1:] + 1``; a prompt ends with text, so its last position
    is the same on all three axes)."""
    length = positions.shape[1]
    if not length:
        return 0
    return whole(float(np.asarray(positions[:, -1]).max()) + 1 - length)


def frequency_axes(mrope_section: Sequence[int], interleaved: bool) -> list[int]:
    """Which position axis (0 temporal, 1 height, 2 width) drives each rotary frequency.

    Blocked (Qwen2-VL): [t]*s0 + [h]*s1 + [w]*s2. Interleaved (Qwen3-VL): frequency i
    follows height if i % 3 == 1 and i < 3*s1, width if i % 3 == 2 and i < 3*s2, else time.
    """
    if not interleaved:
        return [i % 3 for i, size in enumerate(mrope_section) for _ in range(size)]
    _, height, width = mrope_section
    axes = []
    for i in range(sum(mrope_section)):
        if i % 3 == 1 and i < 3 * height:
            axes.append(1)
        elif i % 3 == 2 and i < 3 * width:
            axes.append(2)
        else:
            axes.append(0)
    return axes


class MultimodalRotaryEmbedding:
    """cos/sin tables for (3, L) position ids, each frequency driven by its section's axis."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        mrope_section: Sequence[int],
        interleaved: bool = False,
    ):
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must sum to head_dim / 2 = {head_dim // 2}"
            )
        exponents = mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim
        self.inv_freq = 1.0 / (theta**exponents)
        mx.eval(self.inv_freq)  # a constant: not left lazy on the loading thread's stream
        self.axis_of_frequency = mx.array(frequency_axes(mrope_section, interleaved))

    def __call__(self, position_ids: mx.array) -> tuple[mx.array, mx.array]:
        """(3, L) ids -> (L, 1, head_dim) tables; a batch's (B, 3, L) -> (B, L, 1,
        head_dim): they broadcast over the heads of (B, L, heads, head_dim) projections."""
        positions = mx.take(position_ids, self.axis_of_frequency, axis=-2)  # (..., hd/2, L)
        angles = mx.swapaxes(positions, -1, -2).astype(mx.float32) * self.inv_freq
        angles = mx.concatenate([angles, angles], axis=-1)[..., None, :]
        return mx.cos(angles), mx.sin(angles)

    def for_tokens(self, state, offset: int, n: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """The tables of the ``n`` tokens from ``offset``, in ``dtype``: at the prompt's
        multimodal positions (``state``, an ``MRopeState``), else at text positions."""
        positions = state.positions(offset, n) if state is not None else text_positions(offset, n)
        cos, sin = self(positions)
        return cos.astype(dtype), sin.astype(dtype)


class Attention(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        dim, head_dim = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.scale = head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)

    def __call__(self, x, rotary: tuple[mx.array, mx.array], mask, cache=None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        if "q_norm" in self:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        # Rotated before the heads move forward: MLX's CPU element-wise products are ~3x
        # faster on this layout than on the transposed views.
        cos, sin = rotary
        queries, keys = apply_rotary(queries, cos, sin), apply_rotary(keys, cos, sin)
        queries = queries.transpose(0, 2, 1, 3)
        keys = keys.transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = cached_attention(queries, keys, values, cache, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, index: int = 0):
        super().__init__()
        self.self_attn = Attention(config)
        if config.is_moe_layer(index):
            self.mlp = Qwen3MoeSparseMoeBlock(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, rotary, mask, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), rotary, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MRopeDecoder(TextDecoder):
    """A Qwen decoder: ``layer_class(config, index)`` blocks, an RMSNorm after them and
    the M-RoPE tables over ``rotary_dim`` of each head."""

    layer_class: type

    def __init__(self, config: Any, rotary_dim: int, interleaved: bool):
        super().__init__(
            config.vocab_size, config.hidden_size,
            [self.layer_class(config, i) for i in range(config.num_hidden_layers)],
            nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
        )
        self.rotary = MultimodalRotaryEmbedding(
            rotary_dim, config.rope_theta, config.mrope_section, interleaved
        )


class Qwen2MRopeModel(MRopeDecoder):
    """Pipelined, it runs its own layers between ``receive`` and ``hand_on``."""

    layer_class = DecoderLayer
    runs_pipelined = True
    # A HiddenTap (layers/hidden_tap.py) set by a caller that needs the states, else None.
    hidden_tap = None

    def __init__(self, config: TextConfig):
        super().__init__(config, config.head_dim, config.mrope_interleaved)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        embeddings: mx.array | None = None,
        state: MRopeState | None = None,
    ) -> mx.array:
        h, cache = self.start(inputs, cache, embeddings)
        offset = cache[0].offset if cache[0] is not None else 0
        n = h.shape[1]
        rotary = self.rotary.for_tokens(state, offset, n, h.dtype)
        mask = create_attention_mask(h, cache[0])
        deepstack = None
        if state is not None and state.deepstack is not None:
            deepstack = state.deepstack.window(offset, n)
        tap = self.hidden_tap
        if tap is not None:
            tap.record_input(inputs, h, state)
        h = self.receive(h)
        layers = zip(self.pipeline_layers, cache)
        for index, (layer, layer_cache) in enumerate(layers, start=self.start_idx):
            h = layer(h, rotary, mask, layer_cache)
            if tap is not None and index + 1 < len(self.layers):
                tap.record_layer(index + 1, h)  # before DeepStack, as transformers records
            if deepstack is not None and index < len(deepstack[1]):
                where, features = deepstack
                h = h.at[where].add(features[index].astype(h.dtype))
        out = self.norm(self.hand_on(h, cache))
        if tap is not None:
            tap.record_layer(len(self.layers), out)
        return out


class LanguageModel(nn.Module):
    """``language_model`` in checkpoints: the decoder plus its output head."""

    decoder_class: type = Qwen2MRopeModel  # ``language_model.model``

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = self.decoder_class(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def __call__(
        self, inputs, cache=None, embeddings=None, state=None, last_only=False
    ) -> mx.array:
        h = self.model(inputs, cache, embeddings, state)
        if last_only:
            h = h[:, -1:]
        return self.logits(h)

    def logits(self, hidden: mx.array) -> mx.array:
        """The output head over the decoder's final hidden states (the tied embeddings or
        ``lm_head``): for a caller that scores only some positions."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)
