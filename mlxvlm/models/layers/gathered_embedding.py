"""An embedding table left in its file: each call gathers only the rows its ids name.

Gemma 3n's and Gemma 4 E2B/E4B's per-layer embedding table (``embed_tokens_per_layer``:
a row of every layer's inputs per vocabulary entry) is about half of those checkpoints'
bytes, yet a token reads one row of it. Held whole in memory it is most of what the model
costs; memory-mapped, the operating system reads the rows the prompt and the generated
tokens touch and may drop them again under pressure.

The rows come out as the whole table's lookup would give them: a 16-bit (or float32)
table's rows cast to the compute dtype, a quantized table's packed rows dequantized with
their own scales and biases (in the compute dtype, as ``cpu.quantized`` dequantizes
them). Gathering needs the ids on the host: it evaluates them (the Gemma families read
their ids on the host in every step anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class StoredRows:
    """A 2-D tensor kept on disk: ``rows`` (a ``numpy.memmap``, or any array) holds its
    bytes as numpy can hold them (16-bit floats as uint16), ``dtype`` is what they are."""

    rows: np.ndarray
    dtype: mx.Dtype

    def gather(self, ids: np.ndarray) -> mx.array:
        picked = mx.array(np.ascontiguousarray(self.rows[ids]))
        return picked if picked.dtype == self.dtype else picked.view(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes


@dataclass(frozen=True)
class Quantization:
    group_size: int
    bits: int
    mode: str


class GatheredEmbedding(nn.Module):
    """``nn.Embedding`` / ``nn.QuantizedEmbedding``'s lookup over a table on disk.

    ``weight`` (and for a quantized table ``scales``, ``biases`` and ``quantization``)
    are the stored tensors; ``dtype`` the rows' dtype (None: the stored one, or the
    scales' for a quantized table). The tensors are plain attributes, outside the
    parameter tree: loading, casting, the CPU fast paths and saving leave them alone."""

    def __init__(self, weight: StoredRows, dtype: mx.Dtype | None = None, *,
                 scales: StoredRows | None = None, biases: StoredRows | None = None,
                 quantization: Quantization | None = None):
        super().__init__()
        if (scales is None) != (quantization is None):
            raise ValueError("a quantized table needs both its scales and its quantization")
        self._weight, self._scales, self._biases = weight, scales, biases
        self._quantization = quantization
        self._dtype = dtype
        per_row = weight.rows.shape[1]
        self.num_embeddings = weight.rows.shape[0]
        self.dims = per_row * 32 // quantization.bits if quantization else per_row

    @property
    def stored_bytes(self) -> int:
        """The table's bytes on disk (none of them held in memory)."""
        return sum(t.nbytes for t in (self._weight, self._scales, self._biases) if t is not None)

    def stored_tensors(self) -> dict[str, mx.array]:
        """The whole table as the checkpoint stores it, read into memory (``weight``, and
        ``scales`` / ``biases`` for a quantized one): the parameters the in-memory layer
        would hold, under their names, for whoever must have them all."""
        parts = {"weight": self._weight, "scales": self._scales, "biases": self._biases}
        everything = np.arange(self.num_embeddings)
        return {name: part.gather(everything) for name, part in parts.items() if part is not None}

    def __call__(self, ids: mx.array) -> mx.array:
        flat = np.asarray(ids).reshape(-1)
        rows = self._rows(flat)
        return rows.reshape(*ids.shape, self.dims)

    def _rows(self, flat: np.ndarray) -> mx.array:
        weight = self._weight.gather(flat)
        if self._quantization is None:
            return weight if self._dtype is None else weight.astype(self._dtype)
        q = self._quantization
        scales = self._cast(self._scales.gather(flat))
        biases = None if self._biases is None else self._cast(self._biases.gather(flat))
        rows = mx.dequantize(weight, scales, biases, group_size=q.group_size, bits=q.bits,
                             mode=q.mode)
        return rows if self._dtype is None else rows.astype(self._dtype)

    def _cast(self, part: mx.array) -> mx.array:
        # Integer scales (the mx/nv float formats') are exponents: kept as they are.
        if self._dtype is None or not mx.issubdtype(part.dtype, mx.floating):
            return part
        return part.astype(self._dtype)
