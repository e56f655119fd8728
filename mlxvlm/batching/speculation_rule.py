"""Whether a batched speculative step drafts, or runs as a plain step (no drafts).

What a verify pass costs against a one-token step depends on the machine, the model, the
batch (a pass of B rows x (K + 1) tokens is nearly free while reading the weights bounds
it, and costs up to K + 1 steps once the arithmetic does) and on the drafter (a draft
model's passes, prompt lookup's none); what it gives depends on how many drafts the rows
accept. So the rule measures instead of predicting: for each number of rows it keeps the
tokens per second of its recent speculating steps and of its recent plain ones (an
exponential average), and a step speculates when the first is the higher. A count of rows
seen for the first time speculates, then tries one plain step; after that every
``probe_every``-th step takes the other way, so that a change (acceptance falling as the
answers leave the prompt's words, the batch growing) is noticed. The figures behind it:
benchmarks/README.md, "Speculation under continuous batching".

Greedy answers are the same either way; sampled ones keep the target's distribution
either way (a plain step samples the target's own token).
"""

from __future__ import annotations


class SpeculationRule:
    probe_every = 16
    smoothing = 0.3  # the weight of the newest step in the averages

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive  # False: every step speculates
        self.rates: dict[tuple[int, bool], float] = {}
        self.steps = 0

    def speculates(self, rows: int) -> bool:
        if not self.adaptive:
            return True
        self.steps += 1
        on, off = self.rates.get((rows, True)), self.rates.get((rows, False))
        if on is None:
            return True
        if off is None:
            return False
        better = on >= off
        return (not better) if self.steps % self.probe_every == 0 else better

    def observe(self, rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate = tokens / seconds
        key = (rows, speculated)
        previous = self.rates.get(key)
        self.rates[key] = rate if previous is None else (
            (1 - self.smoothing) * previous + self.smoothing * rate)
