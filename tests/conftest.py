import sys
from pathlib import Path

import pytest

# tests/ holds helper modules (tests/tiny/) imported by the tests.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny HF-format checkpoints (see tests/factory.py), each built once per session."""
    from tiny import TinyCheckpoints

    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-checkpoints"))
