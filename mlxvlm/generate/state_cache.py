"""Layer caches that hold a fixed-size state instead of keys and values, and snapshots of
them for prompt-cache reuse.

Recurrent and convolutional layers (Gated DeltaNet in Qwen3.5, LFM2's short
convolutions, Mamba) keep per sequence a state whose size does not grow with the tokens
seen: mlx-lm gives every such layer an ``ArraysCache`` (a list of arrays the layer
replaces as it runs). Beside the KV caches of a hybrid model's attention layers they
behave differently in three ways, which this module is the one place to know:

- they count no tokens: a sequence's length is read from a layer cache that does
  (``cache_offset``);
- they cannot be trimmed: the state after ``n`` tokens cannot be recovered from the state
  after more, so prompt-cache reuse needs the state *as it was* at the end of the shared
  prefix. ``StateSnapshots`` keeps those states at the lengths where a later prompt may
  diverge (after the prompt's last end-of-turn token, after each prefill chunk, at the end
  of the prompt, at the end of the answer);
  a reused prefix is cut back to the longest snapshot within it, and its KV caches are
  trimmed to the same length;
- their size is fixed, so ``max_kv_size`` (a rotating KV cache) leaves them as they are
  and ``kv_bits`` does not quantize them; batching stacks them one row per sequence (mlx-lm's
  ``ArraysCache.merge`` / ``extend`` / ``filter`` / ``extract``), no padding needed.

Everything here is keyed on the cache *type*, not on a model family: any layer whose
``make_cache`` entry is an ``ArraysCache`` gets the same treatment.

A cross-attention layer's cache (``models.layers.cross_attention.CrossAttentionCache``:
the keys of a sequence's image, Llama 3.2 Vision) is neither: it counts no tokens (no
``offset``, so ``cache_offset`` reads another layer's) and trims to itself, so the loop,
the prefix cache and batching carry it through mlx-lm's cache protocol alone.
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


def is_state_cache(layer_cache: Any) -> bool:
    """Whether a layer's cache is a fixed-size recurrent/convolution state (mlx-lm's
    ``ArraysCache``), not keys and values."""
    return isinstance(layer_cache, ArraysCache)


def state_layer_indices(cache: Sequence[Any]) -> list[int]:
    return [i for i, layer_cache in enumerate(cache) if is_state_cache(layer_cache)]


def cache_offset(cache: Sequence[Any]) -> int:
    """How many tokens a sequence's cache holds: the ``offset`` of its first layer cache
    that counts tokens (state caches do not). 0 for an empty list."""
    for layer_cache in cache:
        if not is_state_cache(layer_cache) and hasattr(layer_cache, "offset"):
            return layer_cache.offset
    if not cache:
        return 0
    raise NotImplementedError(
        "no layer cache counts the tokens (every layer keeps a fixed-size state); "
        "such a model needs its own token count"
    )


def can_trim_except_states(cache: Sequence[Any]) -> bool:
    """Whether every layer cache but the state caches can be trimmed (a prompt-cache entry
    can then be cut to any snapshot's length)."""
    return all(is_state_cache(c) or c.is_trimmable() for c in cache)


def restored_state(arrays: Sequence[Any]) -> ArraysCache:
    """A fresh ``ArraysCache`` holding ``arrays`` (a snapshot's; never changed in place:
    layers replace their state arrays rather than write into them)."""
    layer_cache = ArraysCache(len(arrays))
    layer_cache.cache = list(arrays)
    return layer_cache


def turn_boundaries(input_ids: Sequence[int], end_of_turn_ids: Collection[int]) -> list[int]:
    """Where a snapshot lets the next turn of a chat resume: right after the prompt's last
    end-of-turn token. A follow-up prompt repeats the conversation up to there, while the
    generation prompt after it (``<|im_start|>assistant`` and an opened thinking block) is
    rendered differently once the answer is part of the history."""
    ends = [i + 1 for i, token in enumerate(input_ids) if int(token) in end_of_turn_ids]
    return ends[-1:]


class StateSnapshots:
    """One sequence's state-layer snapshots, by the number of tokens they cover.

    ``record(cache)`` keeps the state arrays of every state layer (references: the arrays
    are immutable once a layer has replaced them) under the cache's current length; a
    cache without state layers records nothing, so callers need not ask. Cheap: a
    snapshot costs each state layer's fixed size once.
    """

    def __init__(self, snapshots: dict[int, dict[int, tuple]] | None = None):
        self._by_length: dict[int, dict[int, tuple]] = dict(snapshots or {})

    def __len__(self) -> int:
        return len(self._by_length)

    @property
    def lengths(self) -> list[int]:
        return sorted(self._by_length)

    @property
    def by_length(self) -> dict[int, dict[int, tuple]]:
        """length -> state layer index -> its arrays (what the constructor takes)."""
        return dict(self._by_length)

    def record(self, cache: Sequence[Any], *, evaluate: bool = False) -> None:
        indices = state_layer_indices(cache)
        if not indices:
            return
        states = {i: tuple(cache[i].cache) for i in indices}
        if evaluate:
            mx.eval([a for arrays in states.values() for a in arrays if a is not None])
        self._by_length[cache_offset(cache)] = states

    def longest_within(self, length: int) -> int | None:
        """The longest snapshot covering at most ``length`` tokens (None: none does)."""
        within = [n for n in self._by_length if 0 < n <= length]
        return max(within) if within else None

    def up_to(self, length: int) -> "StateSnapshots":
        """The snapshots covering at most ``length`` tokens: still valid for a sequence that
        shares those tokens."""
        return StateSnapshots({n: s for n, s in self._by_length.items() if n <= length})

    def restore(self, cache: list[Any], length: int) -> None:
        """Put the states recorded at ``length`` into ``cache``'s state layers."""
        for index, arrays in self._by_length[length].items():
            cache[index] = restored_state(arrays)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for states in self._by_length.values()
                   for arrays in states.values() for a in arrays if a is not None)
