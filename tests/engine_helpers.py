"""What the batching engine's tests share."""

from __future__ import annotations


def run_to_end(engine, limit: int = 10_000) -> None:
    """Step ``engine`` until it has no work left (failing after ``limit`` steps)."""
    for _ in range(limit):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError("the engine did not finish")
