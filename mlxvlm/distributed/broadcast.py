"""Rank 0's objects and tokens, sent to every rank over the group's collectives.

An object (a request: prompt ids, embeddings, the decoder's state, options) travels as a
pickle whose arrays are left out of it and sent as arrays: ``all_sum`` over the group,
rank 0 giving the values and the others zeros, which adds up to rank 0's bits exactly.
The pickle comes only from rank 0 of the same launched job.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxvlm.distributed.group import peer_lost

# Dtypes all_sum carries as they are; others (bool) travel as uint8.
_SUMMABLE = (mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.int64, mx.uint32, mx.uint8,
             mx.int8, mx.int16, mx.uint16, mx.uint64)


def _from_rank0(array: mx.array, group: mx.distributed.Group) -> mx.array:
    """``array`` as rank 0 holds it, on every rank (the others pass one of its shape and
    dtype); on the CPU stream, where every backend's collectives run."""
    dtype = array.dtype
    if dtype not in _SUMMABLE:
        array = array.astype(mx.uint8)
    if group.rank() != 0:
        array = mx.zeros_like(array)
    return mx.distributed.all_sum(array, group=group, stream=mx.cpu).astype(dtype)


class _Pickler(pickle.Pickler):
    def __init__(self, file, arrays: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays = arrays

    def persistent_id(self, obj):
        if isinstance(obj, mx.array):
            self.arrays.append(obj)
            return ("array", len(self.arrays) - 1, tuple(obj.shape), str(obj.dtype))
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, arrays: list):
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, pid):
        return self.arrays[pid[1]]


def _dtype(name: str) -> mx.Dtype:
    return getattr(mx, name.rsplit(".", 1)[-1])


def broadcast_object(obj: Any, group: mx.distributed.Group,
                     announce: Callable[[], None] | None = None) -> Any:
    """Rank 0's ``obj`` on every rank (the others pass None). Raises ``RankLostError``
    when another rank has left. ``announce``: rank 0's collective that tells the others
    an object follows, sent once ``obj`` is pickled (an object that cannot be pickled
    then fails before any rank is told of it)."""
    try:
        return _broadcast(obj, group, announce)
    except RuntimeError as exc:
        raise peer_lost(exc, group) from None


def _broadcast(obj: Any, group: mx.distributed.Group,
               announce: Callable[[], None] | None) -> Any:
    arrays: list[mx.array] = []
    if group.rank() == 0:
        buffer = io.BytesIO()
        _Pickler(buffer, arrays).dump(obj)
        if announce is not None:
            announce()
        payload = np.frombuffer(buffer.getvalue(), dtype=np.uint8)
        header = pickle.dumps([(tuple(a.shape), str(a.dtype)) for a in arrays])
        header_bytes = np.frombuffer(header, dtype=np.uint8)
    else:
        payload = header_bytes = np.zeros(0, dtype=np.uint8)
    lengths = _from_rank0(mx.array([payload.size, header_bytes.size], dtype=mx.int64), group)
    size, header_size = (int(n) for n in lengths.tolist())
    if group.rank() != 0:
        payload = np.zeros(size, dtype=np.uint8)
        header_bytes = np.zeros(header_size, dtype=np.uint8)
    both = _from_rank0(mx.array(np.concatenate([payload, header_bytes])), group)
    raw = bytes(np.asarray(both))
    if group.rank() != 0:
        specs = pickle.loads(raw[size:])
        arrays = [mx.zeros(shape, dtype=_dtype(dtype)) for shape, dtype in specs]
    arrays = [_from_rank0(a, group) for a in arrays]
    mx.eval(arrays)
    if group.rank() == 0:
        return obj
    return _Unpickler(io.BytesIO(raw[:size]), arrays).load()


def broadcast_ints(values: list[int] | None, length: int,
                   group: mx.distributed.Group) -> list[int]:
    """Rank 0's ``values`` (at most ``length``, zero-padded) on every rank, in one
    collective of ``length`` int32s (the others pass None). Raises ``RankLostError``
    when another rank has left."""
    sent = np.zeros(length, dtype=np.int32)
    if group.rank() == 0:
        sent[: len(values)] = values
    try:
        return _from_rank0(mx.array(sent), group).tolist()
    except RuntimeError as exc:
        raise peer_lost(exc, group) from None


def rank0_token(token: mx.array, group: mx.distributed.Group) -> mx.array:
    """Rank 0's sampled token on every rank, left in the graph: every rank then feeds
    the same token back, whatever its own sampler drew from its copy of the logits."""
    return _from_rank0(token, group)


def barrier(group: mx.distributed.Group) -> None:
    """Wait until every rank gets here (``RankLostError`` if one has left)."""
    try:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    except RuntimeError as exc:
        raise peer_lost(exc, group) from None
