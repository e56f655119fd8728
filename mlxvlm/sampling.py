"""The one place a sampler is built from sampling options (``generate``, the batching
engine and so the server and the UI): mlx-lm's samplers, guarded against values that
would make them fail or sample noise."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

Sampler = Callable[[mx.array], mx.array]

# Below this temperature sampling is greedy (vLLM's threshold, _SAMPLING_EPS): mlx-lm
# scales the log-probabilities by 1/T, which for a tiny T overflows float32 to -inf
# everywhere and samples uniformly from garbage; the limit of T -> 0 is the argmax.
GREEDY_BELOW = 1e-5


def build_sampler(temperature: float, top_p: float = 1.0, top_k: int = 0,
                  min_p: float = 0.0) -> Sampler:
    if temperature < GREEDY_BELOW:
        # mlx-lm's one greedy sampler: the batching engine samples rows sharing it together.
        return make_sampler(temp=0.0)
    if top_k <= 0:
        return make_sampler(temp=temperature, top_p=top_p, min_p=min_p)
    return _VocabularyBoundTopK(temperature, top_p, top_k, min_p)


class _VocabularyBoundTopK:
    """Top-k with k bounded by the vocabulary, known only once logits arrive: k at or
    above the vocabulary keeps every token (mlx-lm refuses such a k)."""

    def __init__(self, temperature: float, top_p: float, top_k: int, min_p: float):
        self.options = dict(temp=temperature, top_p=top_p, min_p=min_p)
        self.top_k = top_k
        self._by_width: dict[int, Sampler] = {}

    def __call__(self, logprobs: mx.array) -> mx.array:
        width = logprobs.shape[-1]
        sampler = self._by_width.get(width)
        if sampler is None:
            top_k = self.top_k if self.top_k < width else 0
            sampler = self._by_width[width] = make_sampler(top_k=top_k, **self.options)
        return sampler(logprobs)
