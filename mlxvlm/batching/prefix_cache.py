"""Prompt-cache reuse across requests: a follow-up turn in a conversation continues from
the KV cache its earlier turns left, instead of prefilling (and re-encoding the images
of) the shared prefix again.

Two prompts share a prefix only if their tokens *and the images behind their
placeholder tokens* are equal: the placeholder tokens of two different images of the
same size are identical, so every placeholder token is keyed by a hash of the image
content (see ``prompt_key``).

A family whose every token depends on the prompt's images (Llama 3.2 Vision's
cross-attention, ``media_condition_every_token``) has its prompts with images keyed by
those images throughout: a later turn about the same picture reuses the cache (with the
cross-attention layers' keys of the picture, ``models.layers.cross_attention``), a turn
that adds a picture does not.

Layers whose cache is a fixed-size recurrent or convolution state (see
``generate.state_cache``: Qwen3.5's linear attention, LFM2's convolutions) cannot be
trimmed back to a shared prefix. Their entries carry ``StateSnapshots`` (the states at
the ends of the prefill chunks, of the prompt and of the answer), and a lookup reuses the
longest snapshot within the shared prefix, the KV caches trimmed to the same length.

A prefix hit shows in ``usage.prompt_tokens_details.cached_tokens``, which would tell one
client what another sent before; a server with API keys therefore keys every prompt by
its client's namespace as well, so that reuse stays within one API key.

A spoken request's entry also holds what its thinker tap recorded for the entry's tokens
(``TapRecords``: ids, input embeddings, the talker's layer's hidden states), counted in
the entry's bytes: its talker reads the whole prompt's states, so a spoken lookup
(``lookup(spoken=True)``) takes only entries with records, from memory only, and its hit
hands them on cut to the prefix. A text turn reuses a spoken turn's entry like any other.

Beneath the memory a ``DiskPrefixCache`` (``disk_prefix_cache``) may keep finished
entries across restarts: a lookup asks memory first, then the disk, whose entry joins
the memory when it gives back a longer prefix. The disk keeps no tap records: a spoken
entry is written as a text one (a text turn after a restart resumes from it).
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
from PIL import Image

from mlxvlm.generate.state_cache import (
    StateSnapshots,
    can_trim_except_states,
    is_state_cache,
)

if TYPE_CHECKING:
    from mlxvlm.batching.disk_prefix_cache import DiskPrefixCache
    from mlxvlm.models.layers.hidden_tap import TapRecords


def image_hash(image: Image.Image) -> str:
    """A hash of an image's decoded pixels (so a PNG and a lossless WebP of the same
    picture, or one image sent twice, hash the same)."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _placeholder_runs(ids: np.ndarray, placeholders: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of one placeholder token id."""
    is_placeholder = np.isin(ids, placeholders)
    runs = []
    i, n = 0, ids.shape[0]
    while i < n:
        if not is_placeholder[i]:
            i += 1
            continue
        j = i + 1
        while j < n and ids[j] == ids[i]:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def prompt_key(
    input_ids: Sequence[int] | np.ndarray,
    placeholder_ids: Iterable[int],
    image_hashes: Sequence[str],
    namespace: str | None = None,
    images_reach_every_token: bool = False,
) -> np.ndarray:
    """The prompt's tokens with each placeholder token replaced by a (negative) key of the
    images it may depend on.

    When the prompt has one placeholder run per image (Qwen-VL, Gemma 3 ...), run ``j``
    belongs to image ``j`` and is keyed by the images up to it, so a later turn that adds
    an image still shares everything before it. Otherwise (images whose placeholders
    merge into one run, or tiled images with several runs) every run is keyed by all the
    images, which is always safe.

    With a ``namespace``, every key is XORed with a 62-bit mask drawn from it: a bijection
    within the namespace (its prompts share prefixes exactly as before) whose keys match
    another namespace's only by a 64-bit hash collision.

    ``images_reach_every_token`` (a model's ``media_condition_every_token``: the tokens
    before an image depend on it too) keys a prompt with images as a namespace of its
    own images: such prompts share a prefix only when their images are the same.
    """
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1).copy()
    placeholders = np.fromiter(placeholder_ids, dtype=np.int64)
    runs = _placeholder_runs(ids, placeholders) if placeholders.size else []
    if runs:
        _key_placeholders(ids, runs, image_hashes)
    if images_reach_every_token and len(image_hashes):
        namespace = "\x00".join([namespace or "", "images", *image_hashes])
    if namespace is not None:
        digest = hashlib.sha256(b"mlxvlm-prefix-namespace:" + namespace.encode()).digest()
        # Bit 62 set: a masked key is never a small (token-sized) value of another space.
        ids ^= (int.from_bytes(digest[:8], "little") >> 2) | (1 << 62)
    return ids


def _key_placeholders(ids: np.ndarray, runs: list[tuple[int, int]],
                      image_hashes: Sequence[str]) -> None:
    per_image = len(runs) == len(image_hashes)
    for j, (start, end) in enumerate(runs):
        images = image_hashes[: j + 1] if per_image else image_hashes
        digest = hashlib.sha256("|".join([str(ids[start]), *images]).encode()).digest()
        # Negative, so that it never equals a token id.
        ids[start:end] = -1 - (int.from_bytes(digest[:8], "little") >> 2)


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if differs.size else n


def reusable_length(length: int, key_length: int, whole_only: bool,
                    snapshot_lengths: Sequence[int] | None) -> int:
    """The longest prefix of at most ``length`` tokens an entry of ``key_length`` tokens
    can give back: all of it only (``whole_only``), a snapshot's length (an entry with
    state layers), or any."""
    if whole_only:
        return key_length if length >= key_length else 0
    if snapshot_lengths is None:
        return length
    return max((n for n in snapshot_lengths if 0 < n <= length), default=0)


@dataclass
class _Entry:
    key: np.ndarray  # the keys of the tokens whose keys/values ``cache`` holds
    cache: list[Any]  # per layer, B=1
    state: Any  # the decode-time state made for those tokens (from ``embed``)
    nbytes: int
    # The state layers' states by length, the whole key's included (None: no state layer).
    snapshots: StateSnapshots | None = None
    # A layer cache that cannot be trimmed (a rotating window that has wrapped): the entry
    # is reusable only whole, by a prompt that extends all of it (a chat's next turn).
    whole_only: bool = False
    # A spoken request's: its thinker tap's records of the key's tokens (None: a text one's).
    tap: "TapRecords | None" = None

    def reusable_length(self, length: int) -> int:
        """The longest prefix of at most ``length`` tokens this entry can give back."""
        return reusable_length(length, self.key.shape[0], self.whole_only,
                               self.snapshots.lengths if self.snapshots is not None else None)

    def cut(self, length: int) -> list[Any]:
        """A private copy of the cache holding its first ``length`` tokens."""
        trim = self.key.shape[0] - length
        cache = []
        for index, layer_cache in enumerate(self.cache):
            if is_state_cache(layer_cache):
                cache.append(None)  # restored from the snapshot below
                continue
            layer_cache = copy.deepcopy(layer_cache)
            layer_cache.trim(trim)
            cache.append(layer_cache)
        if self.snapshots is not None:
            self.snapshots.restore(cache, length)
        return cache


@dataclass
class PrefixHit:
    """A reusable prefix: a private copy of the cache holding the first ``length`` tokens of
    the new prompt, the state the entry was made with, and the state-layer snapshots
    within those tokens (still valid for the new prompt, which shares them)."""

    cache: list[Any]
    state: Any
    length: int
    snapshots: StateSnapshots = field(default_factory=StateSnapshots)
    tap: "TapRecords | None" = None  # a spoken lookup's: the first ``length`` positions'


class PrefixCache:
    """The KV caches of recent finished requests, least recently used out first; beneath
    them, where given, the ``disk`` tier.

    Thread-safe; the caches it returns are copies, trimmed to the shared prefix, that the
    caller may extend.
    """

    def __init__(self, max_entries: int = 8, max_bytes: int = 2 << 30,
                 disk: "DiskPrefixCache | None" = None):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.disk = disk
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def insert(self, key: np.ndarray, cache: list[Any], state: Any,
               snapshots: StateSnapshots | None = None, namespace: str | None = None,
               tap: "TapRecords | None" = None) -> None:
        """Keep ``cache`` (holding the tokens ``key`` names) for later prompts. A cache with
        state layers is reusable only at the lengths ``snapshots`` recorded and at its
        own end; without snapshots, only whole. A cache with a layer that is neither
        trimmable nor a state (a rotating KV cache past its window) is reusable only
        whole. ``namespace`` (the API key's, already part of ``key``) labels the entry's
        file on disk. ``tap``: a spoken request's records, of at least the key's tokens
        (fewer: the entry is kept without them)."""
        entry = self._entry(key, cache, state, snapshots)
        if tap is not None and tap.length >= entry.key.shape[0]:
            entry.tap = tap.cut(entry.key.shape[0])
            entry.nbytes += entry.tap.nbytes
        if self.disk is not None:
            self.disk.save(entry.key, namespace, entry.cache, entry.state, entry.snapshots,
                           entry.whole_only)
        self._keep(entry)

    def _entry(self, key: np.ndarray, cache: list[Any], state: Any,
               snapshots: StateSnapshots | None) -> _Entry:
        whole_only = not can_trim_except_states(cache)
        key = np.asarray(key)
        nbytes = sum(c.nbytes for c in cache)
        if any(is_state_cache(c) for c in cache):
            snapshots = (snapshots or StateSnapshots()).up_to(key.shape[0])
            nbytes += snapshots.nbytes
            snapshots.record(cache)
        else:
            snapshots = None
        return _Entry(key, cache, state, nbytes, snapshots, whole_only)

    def _keep(self, entry: _Entry) -> int | None:
        """The entry's id in memory (None: memory keeps nothing)."""
        if self.max_entries <= 0:
            return None
        with self._lock:
            # An entry that the new one extends is no longer needed.
            for entry_id, old in list(self._entries.items()):
                if common_prefix_length(old.key, entry.key) == old.key.shape[0]:
                    del self._entries[entry_id]
            entry_id = self._next_id
            self._entries[entry_id] = entry
            self._next_id += 1
            while self._entries and (
                len(self._entries) > self.max_entries or self.nbytes > self.max_bytes
            ):
                self._entries.popitem(last=False)
        return entry_id

    def lookup(self, key: np.ndarray, namespace: str | None = None,
               spoken: bool = False) -> PrefixHit | None:
        """The entry sharing the longest prefix with ``key``, cut to leave at least the
        last token of ``key`` to be computed (it gives the first new token's logits):
        memory's, or the disk's where it gives back more (``namespace``: the API key's,
        which a file must carry). ``spoken``: only an entry with tap records (memory's),
        its records in the hit."""
        with self._lock:
            best_id, best_length = None, 0
            for entry_id, entry in self._entries.items():
                if spoken and entry.tap is None:
                    continue
                length = min(common_prefix_length(entry.key, key), key.shape[0] - 1)
                length = entry.reusable_length(length)
                if length > best_length:
                    best_id, best_length = entry_id, length
            best = None
            if best_id is not None:
                self._entries.move_to_end(best_id)
                best = self._entries[best_id]
        if self.disk is not None and not spoken:
            found = self.disk.best(key, namespace)
            if found is not None and found[1] > best_length:
                loaded = self.disk.load(found[0], namespace)
                if loaded is not None:
                    best = self._entry(loaded.key, loaded.cache, loaded.state, loaded.snapshots)
                    best_length = found[1]
                    self._keep(best)
        if best is None:
            return None
        # Entries are never changed once inserted, so the copy needs no lock.
        snapshots = best.snapshots.up_to(best_length) if best.snapshots else StateSnapshots()
        tap = best.tap.cut(best_length) if spoken else None
        return PrefixHit(best.cut(best_length), best.state, best_length, snapshots, tap)

    def close(self) -> None:
        """Finish the disk tier's writes."""
        if self.disk is not None:
            self.disk.close()
