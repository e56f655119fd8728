"""The KV cache of one sequence: the family's, made rotating (``max_kv_size``) or
quantized once long enough (``kv_bits``), with mlx-lm's caches. Shared by ``generate``
and the batching engine, which check these options by the same rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxvlm.errors import MlxvlmError, PromptTooLongError
from mlxvlm.prompt import PreparedInputs

# mlx-lm's default: quantize the KV cache only once it is long enough to matter.
DEFAULT_QUANTIZED_KV_START = 5000
# Tokens always kept at the start of a rotating cache (attention sinks), as mlx-lm does.
ROTATING_KEEP = 4


@dataclass(frozen=True)
class CacheOptions:
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START

    def validate(self) -> None:
        if self.kv_bits is not None and self.max_kv_size is not None:
            raise MlxvlmError(
                "--kv-bits cannot be combined with --max-kv-size: mlx-lm's rotating KV cache "
                "cannot be quantized; choose one"
            )

    def make(self, model: nn.Module, inputs: PreparedInputs) -> list[Any]:
        return make_generation_cache(model, inputs, self.max_kv_size)

    def quantize(self, cache: list[Any]) -> None:
        """Replace each full layer cache that has reached ``quantized_kv_start`` tokens by
        its quantized copy (nothing without ``kv_bits``)."""
        if self.kv_bits is None:
            return
        for i, c in enumerate(cache):
            if type(c) is KVCache and c.offset >= self.quantized_kv_start:
                cache[i] = c.to_quantized(group_size=self.kv_group_size, bits=self.kv_bits)


def make_generation_cache(
    model: nn.Module, inputs: PreparedInputs, max_kv_size: int | None
) -> list[Any]:
    """The family's cache; with ``max_kv_size``, full caches become rotating ones that
    always keep the prompt's media tokens (and the first few tokens). Layers whose cache
    is a fixed-size recurrent or convolution state (``state_cache``: Qwen3.5's linear
    attention, LFM2's convolutions) keep it as it is: their state summarizes every token
    seen, so only the attention layers forget what falls out of the window. ``kv_bits``
    (``CacheOptions.quantize``) likewise quantizes only the attention layers' KV caches."""
    cache = model.make_cache()
    if max_kv_size is None:
        return cache
    ids = inputs.input_ids[0].tolist()
    placeholders = model.placeholder_token_ids
    last_media = max((i for i, t in enumerate(ids) if t in placeholders), default=-1)
    keep = max(ROTATING_KEEP, last_media + 1)
    if keep >= max_kv_size:
        raise PromptTooLongError(
            f"--max-kv-size {max_kv_size} is too small: the prompt's media (images, video, "
            f"audio) end at token {last_media + 1}, and a rotating cache must keep them all "
            f"plus room for new tokens; use a --max-kv-size above {keep} (or less media)"
        )
    return [
        RotatingKVCache(max_size=max_kv_size, keep=keep) if type(c) is KVCache else c
        for c in cache
    ]
