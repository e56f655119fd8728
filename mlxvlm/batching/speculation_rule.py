"""When a batched speculative step drafts, and when it runs as a plain step."""

from __future__ import annotations


class SpeculationRule:
    def speculates(self, rows: int) -> bool:
        return True

    def observe(self, rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        pass
