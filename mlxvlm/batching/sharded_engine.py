"""The server's engine on rank 0 of a sharded model: one request at a time, through the
single-sequence loop the other ranks follow.

The batching engine's steps (joins, leaves, prefix reuse) are decided on rank 0 alone,
and the other ranks could not take part in them; ``generate_prepared`` is what every
rank runs in step (``follower``). Requests wait in order; a cancelled request that has
started runs on to its end undelivered, since the other ranks are in its loop too.
``submit``, ``start``, ``close``, ``tokenizer`` and ``stats`` are the batching engine's,
so the server takes this engine in its place.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from mlxvlm.batching.engine import BatchStep, EngineFault, EngineStats, SequenceHandle
from mlxvlm.batching.engine_thread import EngineThread
from mlxvlm.distributed.jobs import release
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.cache import CacheOptions
from mlxvlm.generate.loop import fit_to_context
from mlxvlm.generate.stream import generate_prepared
from mlxvlm.text.tokenization import generation_tokenizer

logger = logging.getLogger(__name__)


class ShardedEngine(EngineThread):
    thread_name = "mlxvlm-sharded"

    def __init__(self, model, processor: Any, *, prefill_step_size: int = 2048):
        self.model = model
        self.processor = processor
        self.tokenizer = generation_tokenizer(processor)
        self.prefill_step_size = prefill_step_size
        self.stats = EngineStats()
        self._waiting: deque = deque()
        self._next_id = 0
        self._init_thread()

    def submit(self, inputs, options, deliver, *, image_hashes=(), cache_namespace=None):
        options.validate()
        fit_to_context(self.model, inputs.num_tokens, options.max_tokens)
        with self._cond:
            if self._closed:
                raise MlxvlmError("the engine is shut down")
            handle = SequenceHandle(self, self._next_id)
            self._next_id += 1
            self._waiting.append((handle, inputs, options, deliver, time.perf_counter()))
            self.stats.waiting = len(self._waiting)
            self._cond.notify()
        return handle

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, finish the running one, then release the other ranks.
        By default the running request is waited out: every rank runs it to its end, and
        a release sent while it runs would be read into its steps' collectives. Past a
        ``timeout`` the other ranks are left unreleased (they stop with this process)."""
        pending = self._stop_thread(timeout, self._take_waiting)
        for _, _, _, deliver, _ in pending:
            _deliver(deliver, MlxvlmError("the engine is shutting down"))
        if self._thread is not None and self._thread.is_alive():
            logger.warning("the running request did not end within %s s: the other ranks "
                           "are not released and stop when this process exits", timeout)
            return
        release(self.model)

    def _take_waiting(self) -> list:
        pending, self._waiting = list(self._waiting), deque()
        return pending

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._wait_for(lambda: bool(self._waiting)):
                    return
                request = self._waiting.popleft()
                self.stats.waiting, self.stats.active = len(self._waiting), 1
            try:
                self._generate(*request)
            except MlxvlmError as exc:
                self.stats.requests_failed += 1
                _deliver(request[3], exc)
            except Exception as exc:  # never leave a caller waiting on a dead thread
                logger.exception("the sharded engine failed a request")
                self.stats.requests_failed += 1
                fault = EngineFault(f"the engine failed ({type(exc).__name__}: {exc})")
                fault.__cause__ = exc
                _deliver(request[3], fault)
            finally:
                self.stats.active = 0

    def _generate(self, handle, inputs, options, deliver, submitted_at) -> None:
        if handle.cancelled:  # not started: the other ranks never hear of it
            self.stats.requests_cancelled += 1
            return
        results = generate_prepared(self.model, self.processor, inputs, options, CacheOptions(),
                                    prefill_step_size=self.prefill_step_size)
        for result in results:  # to its end, even cancelled: every rank is in this loop
            if result.generation_tokens == 1:
                self.stats.time_to_first_token_sum += time.perf_counter() - submitted_at
                self.stats.time_to_first_token_count += 1
                self.stats.prompt_tokens += result.prompt_tokens
            self.stats.generated_tokens += 1
            if handle.cancelled:
                continue
            if not _deliver(deliver, BatchStep(
                    text=result.text, token=result.token, finish_reason=result.finish_reason,
                    prompt_tokens=result.prompt_tokens, cached_tokens=0,
                    generation_tokens=result.generation_tokens, logprob=result.logprob,
                    top_logprobs=result.top_logprobs, stop_string=result.stop_string)):
                handle.cancelled = True  # a broken consumer: the rest goes undelivered
        if handle.cancelled:
            self.stats.requests_cancelled += 1
        else:
            self.stats.requests_finished += 1


def _deliver(deliver, item) -> bool:
    """``deliver(item)``; False where the consumer raised. Its failure must not leave the
    loop: the other ranks run the generation to its end, so this rank must too."""
    try:
        deliver(item)
    except Exception:
        logger.exception("a request's consumer failed; the rest of its answer is dropped")
        return False
    return True
