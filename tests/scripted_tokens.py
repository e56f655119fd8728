"""A random tiny model made to answer with chosen tokens: a logits processor, put before
each sequence's own, masks every other token, through the real engine and detokenizer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxvlm import sampling


def script_tokens(monkeypatch, script: list[int | None]) -> None:
    """Every sequence started from now on answers ``script`` (None: a free step; free
    after the end too)."""
    real = sampling.SamplingOptions.logits_processors

    def with_script(options):
        given = iter(script)

        def force(history, logits):
            token = next(given, None)
            if token is None:  # free, or past the end (the engine may run a step ahead)
                return logits
            keep = mx.arange(logits.shape[-1]) == token
            return mx.where(keep, logits, mx.array(-np.inf, dtype=logits.dtype))

        return [force, *real(options)]

    monkeypatch.setattr(sampling.SamplingOptions, "logits_processors", with_script)
