"""Session fixtures shared by the retrieval tests (registered in conftest.py): the tiny
Qwen3-VL-Embedding and -Reranker checkpoints, and one ``python -m mlxvlm.server``
subprocess serving every tiny retrieval model at once, so that the server tests of
test_retrieval_server.py and test_qwen3_vl_retrieval_parity.py start it once.

The server: ColQwen2 (``--model``, served as "colqwen2") and, from ``--models-dir``,
"colpali", "embedder" (Qwen3-VL-Embedding), "reranker" (Qwen3-VL-Reranker) and "chat" (a
Qwen2-VL chat model), behind the key ``RETRIEVAL_KEY``, with a 200 kB body limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

RETRIEVAL_KEY = "sk-retrieval-test"
# What /v1/models says each model served by ``retrieval_server`` does.
SERVED_CAPABILITIES = {"colqwen2": ["embed", "rerank"], "colpali": ["embed", "rerank"],
                       "embedder": ["embed", "rerank"], "reranker": ["rerank"],
                       "chat": ["chat"]}


@dataclass
class Qwen3Retrieval:
    """The tiny random Qwen3-VL (``tiny``, the torch reference) and its folders:
    "embedding", "reranker", "plain" (no sentence-transformers files) and "named" (the
    plain files in a Hub cache snapshot named Qwen3-VL-Reranker-2B)."""

    tiny: object
    folders: dict[str, Path]


@pytest.fixture(scope="session")
def qwen3_retrieval(tmp_path_factory) -> Qwen3Retrieval:
    from tiny.qwen3_vl_retrieval import (build_retrieval_model, save_embedding, save_plain,
                                         save_reranker)

    tiny = build_retrieval_model(seed=0)
    root = tmp_path_factory.mktemp("qwen3-vl-retrieval")
    plain = save_plain(tiny, root / "plain")
    # A Hub cache download without sentence-transformers files: a real snapshot folder
    # of links, under the repository's name.
    snapshot = root / "models--Qwen--Qwen3-VL-Reranker-2B" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for file in plain.iterdir():
        os.symlink(file, snapshot / file.name)
    return Qwen3Retrieval(tiny, {"embedding": save_embedding(tiny, root / "embedding"),
                                 "reranker": save_reranker(tiny, root / "reranker"),
                                 "plain": plain, "named": snapshot})


@pytest.fixture(scope="session")
def retrieval_server(tiny_checkpoints, qwen3_retrieval, tmp_path_factory):
    from server_process import ServerProcess

    models_dir = tmp_path_factory.mktemp("retrieval-models")
    links = {"chat": tiny_checkpoints.path("qwen2_vl", "transformers"),
             "colpali": tiny_checkpoints.path("colpali", "hub"),
             "embedder": qwen3_retrieval.folders["embedding"],
             "reranker": qwen3_retrieval.folders["reranker"]}
    for name, target in links.items():
        (models_dir / name).symlink_to(target)
    with ServerProcess("--model", str(tiny_checkpoints.path("colqwen2", "hub")),
                       "--served-model-name", "colqwen2", "--models-dir", str(models_dir),
                       "--max-loaded-models", str(len(links) + 1),
                       "--api-key", RETRIEVAL_KEY, "--max-body-bytes", "200000") as process:
        yield process
