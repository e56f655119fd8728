"""The requests waiting for a model that is not loaded (or is giving way to another), in
arrival order: ``ModelPool`` loads the model of the oldest one next and hands every
waiter of a model its lease as soon as that model is loaded, so that each load serves
the requests it was made for."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable

_arrivals = itertools.count()


class Waiter:
    """One waiting request: ``future`` gets its lease (or the error of its model's
    load)."""

    __slots__ = ("model_id", "arrival", "future")

    def __init__(self, model_id: str):
        self.model_id = model_id
        self.arrival = next(_arrivals)
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def live(self) -> bool:
        return not self.future.done()


class ModelWaiters:
    """The live waiters by model, oldest first (a waiter whose client left is taken out
    by ``discard``)."""

    def __init__(self) -> None:
        # Insertion order is arrival order; each model's waiters keep it too.
        self._waiting: dict[str, dict[Waiter, None]] = {}

    def add(self, model_id: str) -> Waiter:
        waiter = Waiter(model_id)
        self._waiting.setdefault(model_id, {})[waiter] = None
        return waiter

    def discard(self, waiter: Waiter) -> None:
        of_model = self._waiting.get(waiter.model_id)
        if of_model is not None:
            of_model.pop(waiter, None)
            if not of_model:
                del self._waiting[waiter.model_id]

    def count(self, model_id: str | None = None) -> int:
        if model_id is not None:
            return len(self._waiting.get(model_id, ()))
        return sum(len(of_model) for of_model in self._waiting.values())

    def oldest_model(self) -> str | None:
        """The model whose first waiter came first (None when nobody waits)."""
        firsts = [next(iter(of_model)) for of_model in self._waiting.values()]
        return min(firsts, key=lambda w: w.arrival).model_id if firsts else None

    def take(self, model_id: str) -> list[Waiter]:
        """The model's waiters, oldest first, no longer waiting here."""
        return [w for w in self._waiting.pop(model_id, {}) if w.live]

    def give(self, model_id: str, lease_of: Callable[[], Any]) -> None:
        """Each live waiter of the model gets ``lease_of()``."""
        for waiter in self.take(model_id):
            waiter.future.set_result(lease_of())

    def fail(self, model_id: str, error: BaseException) -> None:
        for waiter in self.take(model_id):
            waiter.future.set_exception(error)
