"""A random tiny model made to answer with chosen tokens: a logits processor, put before
each sequence's own, masks every other token, through the real engine and detokenizer.
``script_tokens`` does it in this process; ``scripted_environment`` in an entry point's
subprocess (``python -m mlxvlm.server``, ``python -m mlxvlm.generate``), through a
sitecustomize that installs the same processor before the entry point runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxvlm import sampling

SCRIPT_ENV = "MLXVLM_TEST_SCRIPTED_TOKENS"  # read by the sitecustomize below only


def scripted(script: list[int | None]):
    """``SamplingOptions.logits_processors`` with ``script`` forced first."""
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

    return with_script


def script_tokens(monkeypatch, script: list[int | None]) -> None:
    """Every sequence started from now on answers ``script`` (None: a free step; free
    after the end too)."""
    monkeypatch.setattr(sampling.SamplingOptions, "logits_processors", scripted(script))


_SITECUSTOMIZE = f"""\
import json, os, sys
sys.modules["torch"] = None  # as on a user's install: transformers runs torch-free
sys.path.insert(0, {str(Path(__file__).parent)!r})
from mlxvlm import sampling
from scripted_tokens import scripted
sampling.SamplingOptions.logits_processors = scripted(json.loads(os.environ[{SCRIPT_ENV!r}]))
"""


def scripted_environment(folder: Path, script: list[int | None]) -> dict[str, str]:
    """The environment for a subprocess whose every sequence answers ``script``; the
    sitecustomize is written into ``folder``."""
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, SCRIPT_ENV: json.dumps(script), "HF_HUB_OFFLINE": "1"}
