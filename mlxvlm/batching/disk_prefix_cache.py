"""The prompt cache's disk tier: finished conversations' caches kept as safetensors files
in a folder, so that a conversation coming back after a restart resumes from its cache
instead of being prefilled again (the server's ``--prompt-cache-dir``).

``PrefixCache`` (``prefix_cache``) asks its memory first, then this tier; an entry read
from disk joins the memory tier. Each file holds one entry: its layer caches (KV,
rotating windows, recurrent and convolution states), the family's prompt state (its
vision features among them), the state snapshots and the key (``prefix_cache.prompt_key``:
tokens, images' content hashes, the API-key namespace). Its metadata names the model
and adapter it was made with (``checkpoint_fingerprint``) and the API key's namespace
(hashed); its name is ``<key digest>-<file digest>.safetensors``: the digest of the
model, adapter, namespace and key, then the SHA-256 of the whole file.

A file is used only when every check passes -- its header and tensors in bounds, its
name's key digest recomputed from its metadata and key (at start), its model and
namespace this request's, its whole content hashing to its name (before MLX reads any of
it), its cache as long as its key -- and is otherwise ignored with a warning (removed,
when it is damaged): a truncated, flipped or hand-edited file never crashes the server
nor serves a prompt of another API key. Writing happens on a thread of its own (the
engine only evaluates the arrays it hands over), to a hidden temporary file renamed into
place once whole. The folder is kept under ``max_bytes``: the least recently used files
(by modification time, refreshed on each use) go first, whichever model wrote them.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import queue
import re
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from mlxvlm.batching import cache_codec
from mlxvlm.batching.prefix_cache import common_prefix_length, reusable_length
from mlxvlm.generate.state_cache import StateSnapshots, cache_offset, can_trim_except_states
from mlxvlm.mlx_threads import clear_streams_when_thread_ends

logger = logging.getLogger(__name__)

FORMAT = "mlxvlm-prompt-cache/1"
_NAME = re.compile(r"^([0-9a-f]{64})-([0-9a-f]{64})\.safetensors$")
_TEMPORARY_PREFIX = ".writing-"
_MAX_HEADER_BYTES = 64 * 2**20
# safetensors dtype names and their sizes in bytes.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
                "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}
_PENDING_WRITES = 8  # entries waiting for the writer; more are not written
# A temporary file older than this was left by a server that stopped while writing it
# (younger ones may be another server's, writing into the same folder).
_STALE_TEMPORARY_SECONDS = 3600.0
_CLOSE_WAIT_SECONDS = 60.0


class DamagedFile(Exception):
    """A cache file that is not what this tier wrote (truncated, flipped, edited)."""


def checkpoint_fingerprint(checkpoint_path: str | Path | None,
                           adapter_path: str | Path | None = None) -> str:
    """What a cache file's model is: its config.json and its weight files' names and
    sizes (a Hub snapshot's folder also names its commit), and the adapter's files
    whole (small)."""
    digest = hashlib.sha256(FORMAT.encode())
    if checkpoint_path is not None:
        folder = Path(checkpoint_path)
        digest.update(str(folder.resolve()).encode() + b"\0")
        config = folder / "config.json"
        if config.is_file():
            digest.update(config.read_bytes())
        for weights in sorted(folder.glob("*.safetensors")):
            digest.update(f"\0{weights.name}:{weights.stat().st_size}".encode())
    if adapter_path is not None:
        adapter = Path(adapter_path)
        files = sorted(p for p in adapter.iterdir() if p.is_file()) if adapter.is_dir() else [adapter]
        for file in files:
            digest.update(f"\0adapter:{file.name}:".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def namespace_digest(namespace: str | None) -> str:
    marker = b"-" if namespace is None else b"+" + namespace.encode()
    return hashlib.sha256(b"mlxvlm-prompt-cache-namespace:" + marker).hexdigest()


def _key_digest(identity: str, namespace: str, key: np.ndarray) -> str:
    digest = hashlib.sha256(f"{FORMAT}\0{identity}\0{namespace}\0".encode())
    digest.update(np.ascontiguousarray(key, dtype="<i8").tobytes())
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class _Header:
    tensors: dict[str, dict]
    metadata: dict[str, str]
    data_start: int


def _read_header(head: bytes, size: int) -> _Header:
    """A safetensors header, checked: every tensor inside the file, sized by its dtype and
    shape, the data region covered exactly (so that MLX never reads out of bounds)."""
    if size < 8 or len(head) < 8:
        raise DamagedFile("shorter than a safetensors header")
    (length,) = struct.unpack("<Q", head[:8])
    if length > _MAX_HEADER_BYTES or 8 + length > size or len(head) < 8 + length:
        raise DamagedFile("its header runs past the file")
    try:
        header = json.loads(head[8 : 8 + length])
    except ValueError as e:
        raise DamagedFile("its header is not JSON") from e
    if not isinstance(header, dict):
        raise DamagedFile("its header is not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DamagedFile("its metadata is not strings")
    data_size = size - 8 - length
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            valid = (dtype in _DTYPE_BYTES and all(isinstance(d, int) and d >= 0 for d in shape)
                     and isinstance(begin, int) and isinstance(end, int)
                     and 0 <= begin <= end <= data_size
                     and end - begin == count * _DTYPE_BYTES[dtype])
        except (KeyError, TypeError, ValueError) as e:
            raise DamagedFile(f"tensor {name!r} is malformed") from e
        if not valid:
            raise DamagedFile(f"tensor {name!r} does not fit the file")
        spans.append((begin, end))
    spans.sort()
    covered = 0
    for begin, end in spans:
        if begin != covered:
            raise DamagedFile("its tensors overlap or leave gaps")
        covered = end
    if covered != data_size:
        raise DamagedFile("its data region has bytes no tensor holds")
    return _Header(header, metadata, 8 + length)


@dataclass
class _Record:
    """One file of this model in the index."""

    path: Path
    key: np.ndarray
    namespace: str  # namespace_digest
    whole_only: bool
    snapshot_lengths: list[int] | None
    file_digest: str

    def reusable_length(self, key: np.ndarray) -> int:
        length = min(common_prefix_length(self.key, key), key.shape[0] - 1)
        return reusable_length(length, self.key.shape[0], self.whole_only, self.snapshot_lengths)


@dataclass
class LoadedEntry:
    """An entry read back from disk, verified."""

    key: np.ndarray
    cache: list[Any]
    state: Any
    snapshots: StateSnapshots | None


@dataclass
class DiskStats:
    files: int = 0  # this model's files in the index
    loads: int = 0  # entries read back and used
    refused: int = 0  # files ignored as damaged or foreign
    writes: int = 0
    dropped_writes: int = 0  # entries not written: the writer was behind, or no stored form


class DiskPrefixCache:
    def __init__(self, directory: str | Path, max_bytes: int, identity: str):
        """``identity``: ``checkpoint_fingerprint`` of the model served."""
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.identity = identity
        self.stats = DiskStats()
        self._records: dict[str, _Record] = {}  # by file name
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._scan()
        self._queue: queue.Queue = queue.Queue(maxsize=_PENDING_WRITES)
        self._writer = threading.Thread(target=self._write_loop, name="mlxvlm-prompt-cache-writer",
                                        daemon=True)
        self._writer.start()

    # -- the index ---------------------------------------------------------------------

    def _scan(self) -> None:
        others = 0
        for path in sorted(self.directory.iterdir()):
            if path.name.startswith(_TEMPORARY_PREFIX):
                try:
                    if time.time() - path.stat().st_mtime > _STALE_TEMPORARY_SECONDS:
                        path.unlink(missing_ok=True)
                except OSError:
                    pass
                continue
            match = _NAME.match(path.name)
            if match is None or not path.is_file():
                continue
            try:
                record = self._read_record(path, match)
            except DamagedFile as e:
                self._refuse(path, str(e))
                continue
            except OSError:
                continue  # removed meanwhile (another server's eviction)
            if record is None:
                others += 1
            else:
                self._records[path.name] = record
        self.stats.files = len(self._records)
        if others:
            logger.warning("%d prompt-cache files in %s are of another model, adapter or "
                           "format: not used by this one", others, self.directory)
        logger.info("prompt cache on disk: %d files of this model in %s", len(self._records),
                    self.directory)

    def _read_record(self, path: Path, match: re.Match) -> _Record | None:
        """The file's index record; None for another model's (or format's) file."""
        size = path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(min(size, 8 + _MAX_HEADER_BYTES))
            header = _read_header(head, size)
            meta = header.metadata
            if meta.get("format") != FORMAT:
                return None  # another version's: left to it
            key_info = header.tensors.get("key")
            if key_info is None or key_info["dtype"] != "I64" or len(key_info["shape"]) != 1:
                raise DamagedFile("it has no key")
            begin, end = key_info["data_offsets"]
            file.seek(header.data_start + begin)
            key = np.frombuffer(file.read(end - begin), dtype="<i8").astype(np.int64)
        try:
            namespace = meta["namespace"]
            identity = meta["identity"]
            whole_only = json.loads(meta["whole_only"])
            lengths = json.loads(meta["snapshot_lengths"])
            json.loads(meta["layout"])
        except (KeyError, ValueError) as e:
            raise DamagedFile("its metadata is incomplete") from e
        if _key_digest(identity, namespace, key) != match.group(1):
            raise DamagedFile("its name does not match its model, namespace and key")
        if not isinstance(whole_only, bool) or not (
                lengths is None or (isinstance(lengths, list)
                                    and all(isinstance(n, int) for n in lengths))):
            raise DamagedFile("its metadata is malformed")
        if identity != self.identity:
            return None
        return _Record(path, key, namespace, whole_only, lengths, match.group(2))

    def _refuse(self, path: Path, reason: str, remove: bool = True) -> None:
        self.stats.refused += 1
        logger.warning("prompt-cache file %s ignored: %s%s", path.name, reason,
                       " (removed)" if remove else "")
        if remove:
            path.unlink(missing_ok=True)

    # -- reading -----------------------------------------------------------------------

    def best(self, key: np.ndarray, namespace: str | None) -> tuple[str, int] | None:
        """The file of ``namespace`` giving back the longest prefix of ``key``: (its name,
        the length)."""
        space = namespace_digest(namespace)
        best = None
        with self._lock:
            for name, record in self._records.items():
                if record.namespace != space:
                    continue
                length = record.reusable_length(key)
                if length > 0 and (best is None or length > best[1]):
                    best = (name, length)
        return best

    def load(self, name: str, namespace: str | None) -> LoadedEntry | None:
        """The entry of file ``name``, verified, its arrays evaluated on the calling thread;
        None (with a warning, the file removed) when it fails a check."""
        with self._lock:
            record = self._records.get(name)
        if record is None:
            return None
        try:
            data = record.path.read_bytes()
        except OSError:  # evicted meanwhile
            self._forget(name)
            return None
        try:
            entry = self._verified(record, data, namespace_digest(namespace))
        except DamagedFile as e:
            self._forget(name)
            self._refuse(record.path, str(e))
            return None
        try:
            os.utime(record.path)  # used: the last to be evicted
        except OSError:
            pass
        self.stats.loads += 1
        return entry

    def _verified(self, record: _Record, data: bytes, namespace: str) -> LoadedEntry:
        if hashlib.sha256(data).hexdigest() != record.file_digest:
            raise DamagedFile("its content does not match its digest (truncated or changed)")
        header = _read_header(data, len(data))
        meta = header.metadata
        if meta.get("identity") != self.identity or meta.get("namespace") != namespace:
            raise DamagedFile("it belongs to another model or API key")
        try:
            tensors = mx.load(io.BytesIO(data), format="safetensors")
            key = np.array(tensors.pop("key"), dtype=np.int64)
            tree = cache_codec.decode(json.loads(meta["layout"]), tensors)
            cache, state, snapshots = tree["cache"], tree["state"], tree["snapshots"]
            arrays = [a for a in tensors.values()]
            mx.eval(arrays)
            if not np.array_equal(key, record.key) or cache_offset(cache) != key.shape[0]:
                raise DamagedFile("its cache does not hold its key's tokens")
            if record.whole_only != (not can_trim_except_states(cache)):
                raise DamagedFile("its caches' kinds differ from its metadata")
            stored = StateSnapshots(snapshots) if snapshots is not None else None
            if stored is not None and stored.lengths != sorted(record.snapshot_lengths or []):
                raise DamagedFile("its snapshots differ from its metadata")
        except (cache_codec.BadLayout, KeyError, TypeError, ValueError, AttributeError,
                NotImplementedError, RuntimeError) as e:
            raise DamagedFile(f"its content is malformed ({e})") from e
        return LoadedEntry(key, cache, state, stored)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._records.pop(name, None)
            self.stats.files = len(self._records)

    # -- writing -----------------------------------------------------------------------

    def save(self, key: np.ndarray, namespace: str | None, cache: Sequence[Any], state: Any,
             snapshots: StateSnapshots | None, whole_only: bool) -> None:
        """Hand an entry to the writer (on the engine's thread: its arrays are evaluated
        here, where they were made; the file is written on the writer's thread)."""
        tree = {"cache": list(cache), "state": state,
                "snapshots": snapshots.by_length if snapshots is not None else None}
        try:
            if cache_offset(cache) != len(key):
                raise cache_codec.NotStorable("its cache's length is not its key's")
            layout, tensors = cache_codec.encode(tree)
        except (cache_codec.NotStorable, NotImplementedError) as e:
            self.stats.dropped_writes += 1
            logger.debug("prompt cache entry not written to disk: %s", e)
            return
        if sum(t.nbytes for t in tensors.values()) > self.max_bytes:
            self.stats.dropped_writes += 1
            logger.info("prompt cache: an entry larger than --prompt-cache-disk-gb was not "
                        "written")
            return
        tensors["key"] = mx.array(np.asarray(key, dtype=np.int64))
        mx.eval(list(tensors.values()))
        metadata = {
            "format": FORMAT,
            "identity": self.identity,
            "namespace": namespace_digest(namespace),
            "whole_only": json.dumps(bool(whole_only)),
            "snapshot_lengths": json.dumps(snapshots.lengths if snapshots is not None else None),
            "layout": json.dumps(layout),
        }
        try:
            self._queue.put_nowait((np.asarray(key, dtype=np.int64), tensors, metadata))
        except queue.Full:
            self.stats.dropped_writes += 1
            logger.info("prompt cache: the disk writer is behind; an entry was not written")

    def _write_loop(self) -> None:
        clear_streams_when_thread_ends()
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._write(*item)
            except Exception:  # a full disk or a vanished folder must not stop the server
                logger.exception("prompt cache: writing an entry to %s failed", self.directory)

    def _write(self, key: np.ndarray, tensors: dict[str, mx.array],
               metadata: dict[str, str]) -> None:
        temporary = self.directory / f"{_TEMPORARY_PREFIX}{uuid.uuid4().hex}.safetensors"
        try:
            mx.save_safetensors(str(temporary), tensors, metadata)
            file_digest = _file_digest(temporary)
            name = f"{_key_digest(self.identity, metadata['namespace'], key)}-{file_digest}.safetensors"
            path = self.directory / name
            os.replace(temporary, path)  # atomic: a reader sees no file or the whole one
        finally:
            temporary.unlink(missing_ok=True)
        record = _Record(path, key, metadata["namespace"], json.loads(metadata["whole_only"]),
                         json.loads(metadata["snapshot_lengths"]), file_digest)
        with self._lock:
            # Files the new one extends are no longer needed (as in memory).
            for old_name, old in list(self._records.items()):
                if (old.namespace == record.namespace and old_name != name
                        and common_prefix_length(old.key, key) == old.key.shape[0]):
                    del self._records[old_name]
                    old.path.unlink(missing_ok=True)
            self._records[name] = record
        self.stats.writes += 1
        self._evict()

    def _evict(self) -> None:
        """Least recently used files out until the folder fits ``max_bytes``."""
        files = []
        for path in self.directory.iterdir():
            if _NAME.match(path.name):
                try:
                    info = path.stat()
                except OSError:
                    continue
                files.append((info.st_mtime_ns, info.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            self._forget(path.name)
            total -= size
        with self._lock:
            self.stats.files = len(self._records)

    def close(self) -> None:
        """Finish the writes handed over, then stop the writer."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=_CLOSE_WAIT_SECONDS)
