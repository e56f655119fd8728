"""Embedding tables a family reads a few rows of per token, left in the checkpoint's
safetensors files and gathered from there (``models.layers.gathered_embedding``).

A family names such tables in ``gathered_tables`` (Gemma 3n's and Gemma 4's per-layer
embeddings). After the module tree holds the checkpoint's lazily loaded tensors, each
named table (``nn.Embedding`` or ``nn.QuantizedEmbedding``) whose tensors are stored as
they are in some weight file, in any shard, under any name (a Hugging Face checkpoint's
are renamed by ``sanitize``), becomes a ``GatheredEmbedding`` over ``numpy.memmap``s of
those bytes: the lazy tensors are dropped unread. A table whose tensors the loading
changed (cast, sliced, transposed) stays in memory, as before.

Where the bytes are comes from the files' headers (safetensors' layout: an 8-byte
little-endian header size, a JSON header of ``dtype``, ``shape`` and ``data_offsets``
relative to the data after the header); a tensor is recognised by identity: the array
``mx.load`` returned for it is the one the module holds.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.layers.gathered_embedding import GatheredEmbedding, Quantization, StoredRows

# safetensors dtype -> (how numpy holds the bytes, what MLX reads them as); others
# (float64, for one, which MLX cannot compute in) stay in memory.
_STORAGE = {
    "F32": (np.float32, mx.float32),
    "F16": (np.uint16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),
    "U32": (np.uint32, mx.uint32),
    "U8": (np.uint8, mx.uint8),
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: its file, its byte offset there, dtype and shape."""

    file: Path
    offset: int
    dtype: str
    shape: tuple[int, ...]

    def rows(self) -> StoredRows | None:
        """A memory map of the tensor's bytes, or None where it cannot be gathered."""
        if self.dtype not in _STORAGE or len(self.shape) != 2:
            return None
        numpy_dtype, mlx_dtype = _STORAGE[self.dtype]
        rows = np.memmap(self.file, dtype=numpy_dtype, mode="r", offset=self.offset,
                         shape=self.shape)
        return StoredRows(rows, mlx_dtype)


def read_layout(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors ``file``, from its header."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    start = 8 + size
    return {
        name: StoredTensor(file, start + entry["data_offsets"][0], entry["dtype"],
                           tuple(entry["shape"]))
        for name, entry in header.items() if name != "__metadata__"
    }


class TensorLocations:
    """Which stored tensor each array ``mx.load`` read from ``files`` is. Holding the
    loaded arrays keeps their ids from being reused while it is asked."""

    def __init__(self, loaded: dict[Path, dict[str, mx.array]]):
        self._by_id: dict[int, StoredTensor] = {}
        self._arrays = []
        for file, arrays in loaded.items():
            layout = read_layout(file)
            for name, array in arrays.items():
                if name in layout:
                    self._by_id[id(array)] = layout[name]
                    self._arrays.append(array)

    def find(self, array: mx.array | None) -> StoredTensor | None:
        return None if array is None else self._by_id.get(id(array))


def _stored_rows(locations: TensorLocations, array: mx.array | None) -> StoredRows | None:
    where = locations.find(array)
    if where is None or tuple(array.shape) != where.shape:
        return None
    rows = where.rows()
    return rows if rows is not None and rows.dtype == array.dtype else None


def gathered(module: nn.Module, locations: TensorLocations,
             dtype: mx.Dtype | None) -> GatheredEmbedding | None:
    """``module``'s table left on disk, its rows in ``dtype`` (None: as stored); None
    where some tensor of it is not stored as the module holds it."""
    weight = _stored_rows(locations, module.get("weight"))
    if weight is None:
        return None
    if isinstance(module, nn.QuantizedEmbedding):
        scales = _stored_rows(locations, module.get("scales"))
        biases = _stored_rows(locations, module.get("biases"))
        if scales is None or (biases is None and "biases" in module):
            return None
        return GatheredEmbedding(weight, dtype, scales=scales, biases=biases,
                                 quantization=Quantization(module.group_size, module.bits,
                                                           module.mode))
    if type(module) is nn.Embedding:
        return GatheredEmbedding(weight, dtype)
    return None


def keep_tables_on_disk(model: VisionLanguageModel, locations: TensorLocations,
                        dtype: mx.Dtype | None) -> list[str]:
    """The family's ``gathered_tables`` of ``model`` swapped for ``GatheredEmbedding``s,
    in place; returns the module paths swapped."""
    modules = dict(model.named_modules())
    swaps = []
    for path in model.gathered_tables:
        module = modules.get(path)
        table = None if module is None else gathered(module, locations, dtype)
        if table is not None:
            swaps.append((path, table))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return [path for path, _ in swaps]


def describe(model: VisionLanguageModel) -> str | None:
    """What ``--verbose`` says of the tables ``model`` gathers from disk (None: none)."""
    paths = sorted(model.tables_on_disk)
    if not paths:
        return None
    modules = dict(model.named_modules())
    stored = sum(modules[path].stored_bytes for path in paths) / 1e9
    return (f"{', '.join(paths)} read from the checkpoint's files row by row "
            f"({stored:.2f} GB not loaded)")
