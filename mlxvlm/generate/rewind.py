"""Taking a pass's rejected tokens back out of a sequence's cache.

KV caches are trimmed (mlx-lm's ``trim``). What cannot be trimmed -- a recurrent or
convolution state (``state_cache``), or a rotating cache that has wrapped around (its
oldest slots now hold the new tokens) -- is put back as it was before the pass, and the
caller feeds the tokens it keeps again. A checkpoint costs references only: state layers
replace their arrays rather than write into them, and a rotating cache's arrays are held
through a view, which keeps MLX from writing a later one-token update into them in place.
"""

from __future__ import annotations

from typing import Any, Sequence

from mlx_lm.models.cache import RotatingKVCache

from mlxvlm.generate.state_cache import cache_offset, is_state_cache, restored_state


def _saved_layer(layer_cache: Any) -> Any:
    if is_state_cache(layer_cache):
        return tuple(layer_cache.cache)
    if isinstance(layer_cache, RotatingKVCache):
        keys, values, *rest = layer_cache.state
        view = (lambda a: a if a is None else a[:])
        return (view(keys), view(values), *rest)
    return None  # trimmed back to the checkpoint's offset


def trimmable(cache: Sequence[Any]) -> bool:
    """Whether every layer cache can drop its last tokens (mlx-lm's trim)."""
    return all(not is_state_cache(c) and c.is_trimmable() for c in cache)


class CacheCheckpoint:
    """A sequence's cache as it was before a pass, to take the pass's rejected tokens
    back: ``rewind(cache, keep)`` leaves only the first ``keep`` tokens fed since."""

    def __init__(self, cache: Sequence[Any]):
        self.offset = cache_offset(cache)
        self.saved = [_saved_layer(c) for c in cache]

    def rewind(self, cache: list[Any], keep: int) -> bool:
        """True: the cache holds the checkpoint's tokens plus the first ``keep`` fed
        since (rejected ones trimmed). False: it could not be trimmed and is back at the
        checkpoint; the caller feeds the ``keep`` tokens again."""
        drop = cache_offset(cache) - self.offset - keep
        if drop <= 0:
            return True
        if trimmable(cache):
            for layer_cache in cache:
                layer_cache.trim(drop)
            return True
        for i, layer_cache in enumerate(cache):
            saved = self.saved[i]
            if is_state_cache(layer_cache):
                cache[i] = restored_state(saved)
            elif isinstance(layer_cache, RotatingKVCache):
                layer_cache.state = saved
            elif hasattr(layer_cache, "offset"):  # (a cross-attention cache holds no tokens)
                layer_cache.trim(layer_cache.offset - self.offset)
        return False
