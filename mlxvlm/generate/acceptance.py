"""Which drafted tokens a target pass accepts: the exact greedy rule, and for sampling the
standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023), which keeps
the target's distribution whatever the draft proposes.

The distributions are those the sampler draws from: the sequence's processed logits
through mlx-lm's top-p, min-p and top-k filters (in the sampler's order), at its
temperature. Everything here works on numpy rows; a vocabulary of ~10^5 over a handful of
positions costs far less than a target pass.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlxvlm.sampling import GREEDY_BELOW, SamplingOptions


def is_greedy(options: SamplingOptions) -> bool:
    return options.temperature < GREEDY_BELOW


def sampling_distribution(logprobs: mx.array, options: SamplingOptions) -> np.ndarray:
    """The probabilities the sampler of ``options`` draws each row of ``logprobs``
    (normalized processed logits, shape (n, vocab)) from, as float64 rows."""
    filtered = logprobs
    if 0 < options.top_p < 1.0:
        filtered = apply_top_p(filtered, options.top_p)
    if options.min_p != 0.0:
        filtered = apply_min_p(filtered, options.min_p)
    if 0 < options.top_k < filtered.shape[-1]:
        filtered = apply_top_k(filtered, options.top_k)
    scaled = np.asarray((filtered * (1 / options.temperature)).astype(mx.float32), np.float64)
    scaled -= scaled.max(axis=-1, keepdims=True)
    weights = np.exp(scaled)
    return weights / weights.sum(axis=-1, keepdims=True)


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """What a rejection samples from: ``max(p - q, 0)``, normalized (``p`` itself where
    rounding leaves nothing, which exact arithmetic never does after a rejection)."""
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def acceptance_probability(p: np.ndarray, q: np.ndarray, token: int) -> float:
    """``min(1, p(token) / q(token))``; a token the draft could not have drawn (q = 0), or
    one the target has no logit for (a draft head wider than the target's), is never
    accepted."""
    if token >= p.shape[-1] or q[token] <= 0:
        return 0.0
    return min(1.0, p[token] / q[token])


def accept_greedy(target_tokens: Sequence[int], drafts: Sequence[int]) -> tuple[int, int]:
    """``(accepted, next_token)``: the drafts that equal the target's argmax at their
    position, and the target's argmax after the last of them."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, int(target_tokens[accepted])


def accept_sampled(
    p: np.ndarray,
    drafts: Sequence[int],
    q: np.ndarray | None,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """``(accepted, next_token)`` by the speculative-sampling rule. ``p``: the target's
    distributions at the len(drafts) + 1 positions; ``q``: the draft's at each draft
    position (None: each draft was proposed with certainty, as prompt lookup does). Draft
    ``i`` is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``; the first rejection
    draws the next token from ``max(p_i - q_i, 0)``, normalized; all kept, it is drawn
    from the last position's ``p``. Every emitted token is then distributed as the target
    alone would sample it."""
    for i, token in enumerate(drafts):
        q_i = q[i] if q is not None else np.eye(1, p.shape[-1], token)[0]
        if rng.random() < acceptance_probability(p[i], q_i, token):
            continue
        return i, int(rng.choice(p.shape[-1], p=residual_distribution(p[i], q_i)))
    last = len(drafts)
    return last, int(rng.choice(p.shape[-1], p=p[last]))
