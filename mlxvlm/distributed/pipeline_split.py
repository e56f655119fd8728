"""Pipeline parallelism of a decoder that has none of its own (mlx-lm's llama, lfm2,
gemma3n and gemma4 text models carry no ``PipelineMixin``): its loop is left as it is and
its layers are replaced.

As mlx-lm's pipelined models split them, rank 0 runs the last layers and the last rank
the first ones. On each rank a layer it does not hold becomes ``SkippedLayer``: it hands
its input on unchanged, holds no weights, and advances its cache by an empty update so
that the positions and masks the loop reads from any layer's cache stay right. The first
layer a rank holds receives the states from the rank before it; its last sends them on;
after the decoder's last layer rank 0's states reach every rank (each computes the head
and samples as one process does).

Layers that read another layer's keys and values (Gemma 3n's and Gemma 4's KV sharing)
must sit on the same rank as that layer: ``split`` chooses the ranks' runs so.
"""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.distributed.group import depend_on
from mlxvlm.errors import MlxvlmError


def kv_sources(decoder: nn.Module) -> list[int]:
    """For each layer, the layer whose keys and values it attends over (itself, unless
    the decoder shares them: mlx-lm's gemma3n ``layer_idx_to_cache_idx``, gemma4
    ``previous_kvs``)."""
    n = len(decoder.layers)
    for name in ("layer_idx_to_cache_idx", "previous_kvs"):
        sources = getattr(decoder, name, None)
        if sources is not None and len(sources) == n:
            return list(sources)
    return list(range(n))


def split(decoder: nn.Module, size: int) -> list[int] | None:
    """How many layers each rank runs (rank 0 first, as ``PipelineMixin.pipeline``
    takes it): as even as the KV sharing allows; None when no split keeps every layer
    with its source."""
    sources = kv_sources(decoder)
    n = len(sources)
    # A boundary b (a run starting at layer b) may not fall between a layer and its source.
    allowed = [b for b in range(1, n)
               if not any(src < b <= i for i, src in enumerate(sources))]
    boundaries: list[int] = []
    for k in range(1, size):  # the first layer of each later run, lowest first
        target = round(k * n / size)
        candidates = [b for b in allowed if not boundaries or b > boundaries[-1]]
        if len(candidates) < size - k:
            return None
        # Leave enough boundaries for the runs after this one.
        candidates = candidates[: len(candidates) - (size - 1 - k)]
        boundaries.append(min(candidates, key=lambda b: (abs(b - target), b)))
    edges = [0, *boundaries, n]
    runs = [edges[i + 1] - edges[i] for i in range(size)]  # lowest layers first
    return runs[::-1]  # rank 0 runs the last layers


def _plain_attributes(layer: nn.Module) -> dict:
    """What a decoder's loop may read off a layer besides calling it (``use_sliding``,
    ``is_attention_layer``, ``layer_type``): its plain Python attributes."""
    return {k: v for k, v in vars(layer).items()
            if not k.startswith("_") and isinstance(v, (bool, int, float, str))}


class SkippedLayer(nn.Module):
    """A layer another rank runs: its input handed on, its cache advanced by nothing."""

    def __init__(self, layer: nn.Module, extra_outputs: int):
        super().__init__()
        for name, value in _plain_attributes(layer).items():
            setattr(self, name, value)
        self._signature = inspect.signature(type(layer).__call__)
        self._extra_outputs = extra_outputs

    def __call__(self, x, *args, **kwargs):
        try:
            cache = self._signature.bind(self, x, *args, **kwargs).arguments.get("cache")
        except TypeError:
            cache = None
        if cache is not None and hasattr(cache, "update_and_fetch"):
            empty = mx.zeros((x.shape[-3] if x.ndim >= 3 else 1, 0, x.shape[-2], 0), x.dtype)
            cache.update_and_fetch(empty, empty)
        if self._extra_outputs:
            return (x, *([None] * self._extra_outputs))
        return x


class StageLayer(nn.Module):
    """A held layer at a run's edge: it receives the states first, sends them on after,
    and/or (the decoder's last layer) gathers rank 0's states to every rank."""

    def __init__(self, layer: nn.Module, group: mx.distributed.Group, receives: bool,
                 sends: bool, gathers: bool):
        super().__init__()
        for name, value in _plain_attributes(layer).items():
            setattr(self, name, value)
        self.layer = layer
        self.group = group
        self._signature = inspect.signature(type(layer).__call__)
        self._receives, self._sends, self._gathers = receives, sends, gathers

    def __call__(self, x, *args, **kwargs):
        rank = self.group.rank()
        if self._receives:
            x = mx.distributed.recv_like(x, rank + 1, group=self.group)
        out = self.layer(x, *args, **kwargs)
        h, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        if self._sends:
            h = mx.distributed.send(h, rank - 1, group=self.group)
            cache = self._signature.bind(self.layer, x, *args, **kwargs).arguments.get("cache")
            if cache is not None:
                depend_on(cache, h)
        if self._gathers:
            h = mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]
        return (h, *rest) if rest is not None else h


def _extra_outputs(decoder: nn.Module) -> int:
    # Gemma 4's layers return (h, shared keys/values, offset).
    return 2 if hasattr(decoder, "previous_kvs") else 0


def prune(decoder: nn.Module, group: mx.distributed.Group, runs: list[int]) -> tuple[int, int]:
    """Replace the layers this rank does not run by ``SkippedLayer`` (before loading: they
    hold no weights); returns its run [start, end)."""
    rank = group.rank()
    start = sum(runs[rank + 1:])
    end = start + runs[rank]
    extra = _extra_outputs(decoder)
    for i, layer in enumerate(decoder.layers):
        if not start <= i < end:
            decoder.layers[i] = SkippedLayer(layer, extra)
    decoder.pipeline_run = (start, end)
    return start, end


def connect(decoder: nn.Module, group: mx.distributed.Group) -> None:
    """After loading: the run's edges receive, send and gather (see the module docstring)."""
    rank, size = group.rank(), group.size()
    start, end = decoder.pipeline_run
    last = len(decoder.layers) - 1
    edges = {start, end - 1, last}
    for i in sorted(edges):
        receives = i == start and rank < size - 1
        sends = i == end - 1 and rank > 0
        gathers = i == last
        if receives or sends or gathers:
            decoder.layers[i] = StageLayer(decoder.layers[i], group, receives, sends, gathers)


def check(decoder: nn.Module, size: int, family: str) -> list[int]:
    runs = split(decoder, size)
    if runs is None:
        raise MlxvlmError(
            f"the {family} text model's {len(decoder.layers)} layers cannot be split over "
            f"{size} ranks with each KV-sharing layer beside its source; use fewer ranks or "
            "tensor mode (without --pipeline)")
    return runs


