"""Turns on one model between the batching engine's steps and work that must hold the
model alone (a spoken answer: the thinker's hidden-state tap is model-wide, so it records
every pass the model runs while it is set).

The engine takes a turn per step; ``alone()`` waits for the step in progress, then holds
the model until its block ends. Waiting work goes before the engine's next step (the
engine steps in a tight loop, so a plain lock would let it starve a waiter), and callers
of ``alone()`` take the model one at a time."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class ModelTurns:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._stepping = False
        self._held = False
        self._waiting = 0  # callers of alone() not yet holding the model

    @contextmanager
    def step(self) -> Iterator[None]:
        """The engine's turn for one step: after any work waiting to hold the model."""
        with self._cond:
            self._cond.wait_for(lambda: not self._held and not self._waiting)
            self._stepping = True
        try:
            yield
        finally:
            with self._cond:
                self._stepping = False
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        """The model held alone: no engine step and no other ``alone()`` block runs."""
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: not self._held and not self._stepping)
            finally:
                self._waiting -= 1
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()
