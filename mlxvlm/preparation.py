"""Preparing requests (the chat template, media decoding, the processor) off the
caller's thread, in two pools: requests with media in one, text-only requests in the
other, so that a text-only request never waits behind media however long they take to
decode (its own preparation is bounded by ``prompt_length``).

Each job runs inside ``media.preparing`` with a cancel flag that its caller sets when
the client goes away (``PreparationJob.stop``): a job still queued never starts, and a
running one stops at its decoders' next packet or frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

from mlxvlm.media import PreparationCancelled, preparing
from mlxvlm.media.decode_work import check_cancelled
from mlxvlm.mlx_threads import clear_streams_when_thread_ends

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class PreparationStats:
    """Jobs being prepared now, by kind ("media", "text"), and jobs stopped because their
    client went away; thread-safe (workers update it)."""

    preparing: dict[str, int] = field(default_factory=lambda: {"media": 0, "text": 0})
    cancelled: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextlib.contextmanager
    def running(self, kind: str):
        with self._lock:
            self.preparing[kind] += 1
        try:
            yield
        finally:
            with self._lock:
                self.preparing[kind] -= 1

    def count_cancelled(self) -> None:
        with self._lock:
            self.cancelled += 1


class PreparationJob(Generic[T]):
    """A submitted job: its future and its cancel flag."""

    def __init__(self, future: Future, cancel: threading.Event, stats: PreparationStats):
        self.future = future
        self.cancel = cancel
        self._stats = stats

    def stop(self) -> None:
        """The client went away: drop the job if it has not started, else stop it at its
        next check."""
        self.cancel.set()
        if self.future.cancel():
            self._stats.count_cancelled()
            log.info("dropped a queued request's preparation: the client went away")

    async def result(self) -> T:
        """The job's result, awaited; if the awaiting task is cancelled (the client went
        away), the job is stopped too."""
        try:
            return await asyncio.wrap_future(self.future)
        except asyncio.CancelledError:
            self.stop()
            raise


class PreparationPools:
    """``media_workers`` threads for requests with media, ``text_workers`` for the
    others."""

    def __init__(self, media_workers: int, text_workers: int, *,
                 stats: PreparationStats | None = None, name: str = "mlxvlm-prepare"):
        self.stats = stats or PreparationStats()
        self._running: set[threading.Event] = set()  # the cancel flags of running jobs
        self._pools = {
            "media": ThreadPoolExecutor(media_workers, thread_name_prefix=f"{name}-media",
                                        initializer=clear_streams_when_thread_ends),
            "text": ThreadPoolExecutor(text_workers, thread_name_prefix=f"{name}-text",
                                       initializer=clear_streams_when_thread_ends),
        }

    def submit(self, job: Callable[[], T], *, media: bool) -> PreparationJob[T]:
        kind = "media" if media else "text"
        cancel = threading.Event()
        # The worker's work item outlives the job's result by a moment: it must not keep
        # the job (and what the job holds, such as a session and its model) alive then.
        pending = [job]

        def run() -> T:
            self._running.add(cancel)
            try:
                with self.stats.running(kind), preparing(cancel):
                    check_cancelled("preparing the request")  # gone while it was queued
                    return pending.pop()()
            except PreparationCancelled as stopped:
                self.stats.count_cancelled()
                log.info("%s", stopped)
                raise
            finally:
                self._running.discard(cancel)

        return PreparationJob(self._pools[kind].submit(run), cancel, self.stats)

    def close(self) -> None:
        """Drop the queued jobs and stop the running ones (a process exits only once its
        workers are done)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for cancel in list(self._running):
            cancel.set()
