"""What rank 0 tells the other ranks: the next generation to run with it (the CLI), the
next pass of the server's batch, or the end.

A ``GenerationJob`` is everything the shared loop needs besides the model: the prompt's
ids, the embeddings rank 0's towers made (and the decoder's state, such as M-RoPE
positions), the sampling and cache options. Every rank then runs the same loop; the
tokens are rank 0's (``broadcast.rank0_token``), so the ranks stop together (end of
sequence, stop strings, the token budget are all decided on those tokens).

A ``StepPlan`` is one forward pass of the sharded server's continuous batch (rank 0's
``batching.lockstep``; the others replay it in ``batching.sharded_follower``): what
changed in the caches since the previous plan, then the pass's inputs. Rank 0 alone
samples; the tokens it feeds back are the next plan's inputs. A plan travels as one
collective of a few int32s where it is a plain decode step (its tokens), else as that
and a pickle (``announce_step``, ``next_step``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxvlm.distributed.broadcast import barrier, broadcast_ints, broadcast_object
from mlxvlm.distributed.group import peer_lost


@dataclass
class GenerationJob:
    input_ids: mx.array
    embeddings: mx.array
    state: Any
    options: Any  # SamplingOptions, without a grammar (rank 0's tokens already obey it)
    cache_options: Any  # CacheOptions
    max_tokens: int
    prefill_step_size: int


@dataclass
class PassCall:
    """One forward pass: ``model(input_ids, cache, embeddings=..., state=...,
    last_only=...)`` on the cache of sequence ``target`` (None: the decode batch's)."""

    target: int | None
    input_ids: mx.array
    embeddings: mx.array | None
    state: Any  # only where ``state_sent``: else the target's state as last sent
    state_sent: bool
    last_only: bool
    # The target sequence's cache length on rank 0 before the pass: shorter than a
    # follower's after a speculative pass whose rejected tokens rank 0 took back.
    offset: int | None


@dataclass
class StepPlan:
    """One pass of the sharded server's batch, with the cache changes before it, in
    order: ``("start", id, input_ids, cache_options)`` (a sequence's own cache made),
    ``("join", id, merged)`` (that cache becomes the decode batch's last row, or the
    batch's only one), ``("keep", indices)`` (only those rows stay). ``live``: the
    sequences whose own caches rank 0 still holds (the others' are dropped); None: the
    same as in the previous plan.
    ``call`` is None for a plan of changes only (rank 0 going idle)."""

    ops: list
    live: tuple[int, ...] | None
    call: PassCall | None


def leads(model) -> bool:
    """Whether this process is rank 0 of a sharded model."""
    plan = model.sharding
    return plan is not None and plan.rank == 0


def announce(model, job: GenerationJob) -> None:
    """Rank 0: send ``job`` to the other ranks (they run it in ``follower.follow``)."""
    options = dataclasses.replace(job.options, constraint=None)
    broadcast_object(dataclasses.replace(job, options=options), model.sharding.group)


# A server's step travels as one fixed-size collective of int32s: a decode step with
# nothing else to say (most steps) as its tokens; any other plan as a pickle after it.
_STEP_HEADER = 64
_OBJECT, _DECODE, _RELEASE = 1, 2, 3


def announce_step(model, plan: StepPlan) -> None:
    """Rank 0: send ``plan`` to the other ranks (``RankLostError`` if one has left)."""
    group = model.sharding.group
    tokens = _plain_decode(plan)
    if tokens is not None and len(tokens) <= _STEP_HEADER - 2:
        broadcast_ints([_DECODE, len(tokens), *tokens], _STEP_HEADER, group)
        return
    broadcast_object(plan, group,
                     announce=lambda: broadcast_ints([_OBJECT], _STEP_HEADER, group))


def _plain_decode(plan: StepPlan) -> list[int] | None:
    """The tokens a decode step over the batch feeds, where the step is nothing more:
    no cache changes, the same sequences held, the batch's state as last sent."""
    call = plan.call
    if (plan.ops or plan.live is not None or call is None or call.target is not None
            or call.state_sent or call.embeddings is not None or not call.last_only
            or call.input_ids.ndim != 2 or call.input_ids.shape[1] != 1):
        return None
    return call.input_ids[:, 0].tolist()


def release_steps(model) -> None:
    """Rank 0 of a sharded server: its followers (``next_step``) return; as ``release``."""
    if leads(model):
        broadcast_ints([_RELEASE], _STEP_HEADER, model.sharding.group)
        barrier(model.sharding.group)


def next_step(model) -> StepPlan | None:
    """A sharded server's other ranks: rank 0's next step, None at the release
    (acknowledged)."""
    group = model.sharding.group
    header = broadcast_ints(None, _STEP_HEADER, group)
    if header[0] == _DECODE:
        count = header[1]
        tokens = mx.array(header[2 : 2 + count], dtype=mx.int32)[:, None]
        return StepPlan([], None, PassCall(None, tokens, None, None, False, True, None))
    if header[0] == _RELEASE:
        barrier(group)
        return None
    return broadcast_object(None, group)


def release(model) -> None:
    """Rank 0: tell the other ranks there is nothing more to run (they return). Returns
    once every rank has taken the release, so that a rank that failed to take it fails
    this one too (``RankLostError``) rather than rank 0 ending well without it."""
    if leads(model):
        broadcast_object(None, model.sharding.group)
        barrier(model.sharding.group)


def next_job(model) -> GenerationJob | None:
    """The other ranks: rank 0's next job, None at the end (the release, acknowledged)."""
    job = broadcast_object(None, model.sharding.group)
    if job is None:
        barrier(model.sharding.group)
    return job


def peer_checked(model, tokens):
    """``tokens`` (the loop's), with a collective that fails because another rank left
    reported as ``RankLostError`` rather than MLX's bare RuntimeError."""
    plan = model.sharding
    if plan is None:
        yield from tokens
        return
    try:
        yield from tokens
    except RuntimeError as exc:
        raise peer_lost(exc, plan.group) from None
