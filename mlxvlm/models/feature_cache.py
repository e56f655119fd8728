"""Vision (and audio) features computed once per distinct input and reused across turns.

In a multi-turn chat every request carries the whole conversation, so each turn would
run the vision tower again over every image seen so far. Each model instance holds a
``FeatureCache`` (``model.feature_cache``, made by ``VisionLanguageModel.__init__``), so
the CLI, the server and the UI, which all go through the model, share it.

A family's ``embed`` hands ``cached_features`` its batch split into items (an image, an
image tile, a video, ...) together with the arrays the tower reads for each item, and a
function that runs the tower on a subset of the items. The items' keys are content
hashes of those preprocessed arrays -- pixel bytes, shape and dtype, and any per-item
grid, size or mask -- so that the preprocessing settings (resolution limits, tiling)
are part of the key: the same picture processed another way is another item. Only the
misses go through the tower (together, as one batch); the features come back in the
original order, equal to what the tower gives for the whole batch up to float32 rounding
(every family's tower computes each item independently of the others in its batch; a
BLAS may round a product differently for another number of rows).

The cache is bounded in bytes (``MLXVLM_FEATURE_CACHE_GB``, default 1; 0 turns it off)
and forgets the least recently used entries first. Entries are evaluated arrays with
their own buffers, so an entry keeps neither a lazy graph nor a whole batch alive.

Training must not read it: the loss needs gradients through the tower, and augmented
pixels change every step. ``no_feature_cache()`` turns it off for the current thread
(mlxvlm.finetune's loss runs under it), and changing a model's weights through
``update`` / ``update_modules`` (``load_weights``, adapters, optimizer steps, dtype
changes) empties its cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
import os
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from mlxvlm.models.run_ahead import bounded_run_ahead

ENV_VAR = "MLXVLM_FEATURE_CACHE_GB"
DEFAULT_GB = 1.0

Features = tuple[mx.array, ...]

_bypass: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mlxvlm_no_feature_cache", default=False
)


def default_max_bytes() -> int:
    """The cache's bound from ``MLXVLM_FEATURE_CACHE_GB`` (decimal GB; 0 disables it)."""
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return int(DEFAULT_GB * 1e9)
    try:
        gb = float(value)
    except ValueError:
        gb = math.nan
    if not math.isfinite(gb) or gb < 0:
        raise ValueError(
            f"{ENV_VAR} must be a size in GB (a number >= 0; 0 turns the feature cache "
            f"off), not {value!r}"
        )
    return int(gb * 1e9)


@contextlib.contextmanager
def no_feature_cache() -> Iterator[None]:
    """Within this block (on this thread), ``cached_features`` neither reads nor fills
    any model's cache: every item goes through the tower, with its autograd graph."""
    token = _bypass.set(True)
    try:
        yield
    finally:
        _bypass.reset(token)


class FeatureCache:
    """A thread-safe LRU map from content keys (``content_key``) to evaluated feature
    arrays, bounded by their total size in bytes (``max_bytes``; 0: store nothing).
    ``hits`` and ``misses`` count lookups."""

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = default_max_bytes() if max_bytes is None else max(int(max_bytes), 0)
        self._entries: OrderedDict[bytes, Features] = OrderedDict()
        self._sizes: dict[bytes, int] = {}
        self._nbytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the entries."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Features | None:
        """The entry for ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: bytes, value: Features) -> bool:
        """Store ``value`` (evaluated here) under ``key``, evicting the least recently used
        entries to stay within ``max_bytes``. Returns False (stores nothing) when the
        cache is off or ``value`` alone is larger than the bound."""
        value = tuple(value)
        size = sum(a.nbytes for a in value)
        if size > self.max_bytes:
            return False
        mx.eval(value)
        with self._lock:
            if key in self._entries:
                self._nbytes -= self._sizes[key]
            self._entries[key] = value
            self._entries.move_to_end(key)
            self._sizes[key] = size
            self._nbytes += size
            while self._nbytes > self.max_bytes:
                old, _ = self._entries.popitem(last=False)
                self._nbytes -= self._sizes.pop(old)
        return True

    def clear(self) -> None:
        """Forget every entry (the counters stay)."""
        with self._lock:
            self._entries.clear()
            self._sizes.clear()
            self._nbytes = 0

    def __repr__(self) -> str:
        return (
            f"FeatureCache({len(self)} entries, {self._nbytes / 1e6:.1f} of "
            f"{self.max_bytes / 1e6:.0f} MB, {self.hits} hits, {self.misses} misses)"
        )


# ------------------------------------------------------------------------------ keys


def _as_numpy(value: Any) -> tuple[np.ndarray, str]:
    """An array's data as numpy and its dtype's name (numpy's; an MLX array hashes as the
    numpy array it converts to, and bfloat16, which numpy lacks, by its raw 16 bits)."""
    if isinstance(value, mx.array) and value.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.asarray(value.view(mx.uint16))), "bfloat16"
    array = np.ascontiguousarray(np.asarray(value))
    return array, array.dtype.str


def _update(digest, part: Any) -> None:
    if part is None:
        digest.update(b"N;")
    elif isinstance(part, str):
        digest.update(f"S{len(part)}:".encode() + part.encode())
    elif isinstance(part, (bool, int, float)):
        digest.update(f"V{part!r};".encode())
    elif isinstance(part, (tuple, list)):
        digest.update(f"L{len(part)}:".encode())
        for item in part:
            _update(digest, item)
    else:
        array, dtype = _as_numpy(part)
        digest.update(f"A{dtype}{array.shape}:".encode())
        digest.update(array.data if array.size else b"")


def content_key(kind: str, *parts: Any) -> bytes:
    """A 32-byte blake2b hash of ``kind`` and ``parts``: arrays (numpy or MLX; their
    dtype, shape and bytes), numbers, strings and nested tuples/lists of them."""
    digest = hashlib.blake2b(digest_size=32)
    _update(digest, kind)
    for part in parts:
        _update(digest, part)
    return digest.digest()


# --------------------------------------------------------------------------- lookups


def active_cache(model: Any) -> FeatureCache | None:
    """``model``'s feature cache, or None where caching is off: no cache, a zero bound,
    or inside ``no_feature_cache()``."""
    cache = getattr(model, "feature_cache", None)
    if cache is None or not cache.enabled or _bypass.get():
        return None
    return cache


def cached_features(
    model: Any,
    kind: str,
    items: Sequence[Sequence[Any]],
    encode: Callable[[list[int]], Sequence[Features]],
) -> list[Features]:
    """Per item, its features, computing only those not in ``model.feature_cache``.

    ``items``: per item, everything the tower reads for it (``content_key``'s parts).
    ``kind`` names what they are (``"image"``, ``"video"``, ...). ``encode(indices)``
    runs the tower on those items -- batched as the family batches -- and returns one
    tuple of arrays per index, in order. With the cache off (no ``feature_cache``, a
    zero bound, or inside ``no_feature_cache()``), ``encode`` gets every index and its
    output is returned as it is."""
    cache = active_cache(model)
    if cache is None:
        return [tuple(out) for out in encode(list(range(len(items))))]

    keys = [content_key(kind, *parts) for parts in items]
    found: dict[bytes, Features] = {}
    first_miss: dict[bytes, int] = {}  # an item repeated in one prompt is encoded once
    for index, key in enumerate(keys):
        if key in found or key in first_miss:
            continue
        value = cache.get(key)
        if value is None:
            first_miss[key] = index
        else:
            found[key] = value
    if first_miss:
        with bounded_run_ahead():  # built and evaluated a layer at a time
            outputs = [tuple(out) for out in encode(list(first_miss.values()))]
            if len(outputs) != len(first_miss):
                raise ValueError(
                    f"the {kind} encoder gave {len(outputs)} results for {len(first_miss)} items"
                )
            mx.eval(outputs)
        for key, out in zip(first_miss, outputs):
            # Own buffers: a slice of the batch's output would keep the whole batch alive.
            value = tuple(mx.array(a) for a in out)
            cache.put(key, value)
            found[key] = value
    return [found[key] for key in keys]


def split_rows(array: mx.array, sizes: Sequence[int]) -> list[mx.array]:
    """``array`` cut along its first axis into consecutive pieces of ``sizes`` rows."""
    bounds = np.cumsum(sizes)[:-1].tolist()
    return mx.split(array, bounds, axis=0) if bounds else [array]


def join_rows(pieces: Sequence[mx.array]) -> mx.array:
    """``split_rows`` undone: the pieces stacked along their first axis."""
    return pieces[0] if len(pieces) == 1 else mx.concatenate(list(pieces), axis=0)


def cached_rows(
    model: Any, kind: str, encode_batch: Callable[..., mx.array], *inputs: Any
) -> mx.array:
    """``encode_batch(*inputs)`` for a tower that encodes each row of its inputs (images,
    tiles: the first axis of every input) on its own, rows found in the model's feature
    cache taken from it and only the others encoded: (rows, ...) in the inputs' order."""
    count = len(inputs[0])
    if count == 0 or active_cache(model) is None:
        return encode_batch(*inputs)

    def take(x: Any, indices: list[int]) -> Any:
        if len(indices) == count:
            return x
        return x[mx.array(indices)] if isinstance(x, mx.array) else np.asarray(x)[indices]

    def encode(indices: list[int]) -> list[Features]:
        out = encode_batch(*(take(x, indices) for x in inputs))
        return [(out[i],) for i in range(out.shape[0])]

    items = [tuple(x[i] for x in inputs) for i in range(count)]
    outputs = cached_features(model, kind, items, encode)
    return mx.stack([out[0] for out in outputs])
