"""A talker's sampled draws seeded from the request's seed, one seed per draw
(``step_seed`` of the draw's index and stage), so that a seeded talker speaks the same
codes whatever drew from MLX's random state between its steps (the thinker's sampling,
interleaved with it, or other requests'). Both families' talker streams seed with it."""

from __future__ import annotations

import mlx.core as mx

from mlxvlm.sampling import step_seed


def seed_draw(seed: int | None, greedy: bool, stage: str, draw: int) -> None:
    """Seeds MLX's random state for draw ``draw`` of ``stage`` (e.g. ``"talker"``);
    nothing when unseeded (``seed`` None: MLX's global state) or greedy (no draw)."""
    if seed is not None and not greedy:
        mx.random.seed(step_seed(seed, draw, stage))
