import os
import sys
from pathlib import Path

import pytest

# The parity references and the tiny-checkpoint builders are transformers' torch models:
# mlxvlm leaves transformers' torch support on (see mlxvlm/torch_free.py;
# tests/test_no_torch_at_runtime.py checks the torch-free start-up in fresh processes).
os.environ["MLXVLM_ALLOW_TORCH"] = "1"

# As a user's program does: mlxvlm before mlx.core, so that the CPU backend's BLAS set-up
# (OpenBLAS and the sgemv shim, mlxvlm/cpu/blas.py) is what the tests exercise.
import mlxvlm  # noqa: F401

# transformers imported now, with torch: the test process's decision is taken
# (mlxvlm.torch_free leaves an imported transformers alone), and the setting leaves the
# environment, so that every command a test starts in a subprocess (servers, the CLIs,
# mlx.launch ranks) runs torch-free, as a user's does.
import transformers  # noqa: E402,F401

del os.environ["MLXVLM_ALLOW_TORCH"]

# tests/ holds helper modules (tests/tiny/) imported by the tests.
sys.path.insert(0, str(Path(__file__).parent))

# Session fixtures of the retrieval tests: one server for all their tiny models.
pytest_plugins = ["retrieval_fixtures"]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny HF-format checkpoints (see tests/factory.py), each built once per session."""
    from tiny import TinyCheckpoints

    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-checkpoints"))


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty mlxvlm build cache (kernels, BLAS shim, compiler versions) for one test."""
    from mlxvlm.cpu import build_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(build_cache.REBUILD_ENV, raising=False)
    return tmp_path / "mlxvlm"


@pytest.fixture(scope="session")
def speaking_checkpoint(tmp_path_factory):
    """A tiny Qwen3-Omni that speaks (thinker, talker, code2wav), built once for the
    server's and the chat UI's speech tests."""
    from tiny import qwen3_omni_speech

    tiny = qwen3_omni_speech.build_tiny_model("qwen3_omni_moe_speech", seed=2)
    return str(qwen3_omni_speech.save_checkpoint(
        tiny, tmp_path_factory.mktemp("qwen3-omni-speech"), "hub"))


@pytest.fixture(scope="session")
def speaking_qwen2_5_checkpoint(tmp_path_factory):
    """A tiny Qwen2.5-Omni that speaks (thinker, talker, token2wav), built once for the
    tests of answers spoken together (its seed: one whose greedy talker speaks more than
    a few codes for their prompts)."""
    from tiny import qwen2_5_omni_speech

    tiny = qwen2_5_omni_speech.build_tiny_model("qwen2_5_omni_speech", seed=3)
    return str(qwen2_5_omni_speech.save_checkpoint(
        tiny, tmp_path_factory.mktemp("qwen2_5-omni-speech"), "hub"))
