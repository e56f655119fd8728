"""The environment a user's process runs in, for the tests' subprocesses: torch-free.

tests/conftest.py sets ``MLXVLM_ALLOW_TORCH=1`` in the test process (its references are
transformers' torch models); a subprocess that inherited it would import torch as it
starts (seconds and hundreds of MB per process, see mlxvlm/torch_free.py), as no
user's process does."""

from __future__ import annotations

import os


def user_environment(**extra: str) -> dict[str, str]:
    """``os.environ`` without ``MLXVLM_ALLOW_TORCH``, with ``extra`` set."""
    env = {k: v for k, v in os.environ.items() if k != "MLXVLM_ALLOW_TORCH"}
    env.update(extra)
    return env
