"""The group ``mlx.launch`` started this process in, and what a rank's shard holds."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxvlm.errors import MlxvlmError

MODES = ("tensor", "pipeline")


class RankLostError(MlxvlmError):
    """Another rank of the group left the run (it exited or its connection broke)."""


def launched_group() -> mx.distributed.Group | None:
    """The group of this process under ``mlx.launch`` (or mpirun), None when it runs
    alone. ``mx.distributed.init()`` gives a group of one without a launcher."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def peer_lost(exc: BaseException, group: mx.distributed.Group) -> RankLostError:
    """The one-line error rank 0 reports when a collective fails under it."""
    return RankLostError(
        f"rank {group.rank()} of {group.size()}: another rank left the run ({exc}); "
        "mlx.launch's warnings above name the rank that exited and its exit code"
    )


@dataclass(frozen=True)
class ShardPlan:
    """How the language model is split over ``group``: ``mode`` "tensor" (every rank a
    1/size slice of each attention and MLP) or "pipeline" (each rank a run of layers;
    mlx-lm's order: rank 0 the last layers, the last rank the first ones). Rank 0 alone
    holds the vision/audio towers, runs them on the prompt's media and sends their
    embeddings on (see ``broadcast``): they are small beside the decoder, and only rank 0
    has the request's media."""

    group: mx.distributed.Group
    mode: str
    layers: tuple[int, int] | None = None  # pipeline: [start, end) of this rank
    num_layers: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise MlxvlmError(f"unknown sharding mode {self.mode!r} (choose from {MODES})")

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def holds_towers(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        """What this rank holds, for ``--verbose``."""
        towers = "; the vision/audio towers" if self.holds_towers else ""
        if self.mode == "tensor":
            share = "half" if self.size == 2 else f"1/{self.size}"
            return (f"rank {self.rank}: {share} of every attention and MLP "
                    f"(tensor parallel over {self.size} ranks){towers}")
        start, end = self.layers
        held = f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"
        return (f"rank {self.rank}: {held} of {self.num_layers} "
                f"(pipeline over {self.size} ranks){towers}")


def depend_on(layer_cache, h: mx.array) -> None:
    """Make ``layer_cache``'s state depend on ``h`` (a send), so that the send runs
    whenever the cache is evaluated (a prefill chunk evaluates only the caches): a KV
    cache's keys, or a recurrent layer's state (mlx-lm's ArraysCache)."""
    if getattr(layer_cache, "keys", None) is not None:
        layer_cache.keys = mx.depends(layer_cache.keys, h)
    elif hasattr(layer_cache, "cache") and layer_cache.cache[-1] is not None:
        layer_cache.cache[-1] = mx.depends(layer_cache.cache[-1], h)
