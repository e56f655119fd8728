"""Which retrieval use a checkpoint has: a registry of detectors that ``mlxvlm.load``
consults once the model and its processor are built.

A detector is a function ``(config: dict, model_path: Path) -> RetrievalUse | None``
(``config``: the checkpoint's config.json; ``model_path``: its directory, for the files
beside it, such as sentence-transformers' ``modules.json`` or a processor config): it
returns the use when the checkpoint is one of its models, else None. ``DETECTORS``
names each as ``"module:function"``, imported only when a checkpoint is loaded; the
first that answers wins, so a detector that reads marks beyond ``model_type`` (the same
``qwen3_vl`` type is a chat model, an embedding model or a reranker) must not claim a
checkpoint without them.

A new retrieval model is: its family (or a variant of one) in ``models/`` for the
forward pass, a use in ``retrieval/`` for its prompts and pooling, and its detector's
line here.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

from mlxvlm.retrieval.use import RetrievalUse

Detector = Callable[[dict, Path], "RetrievalUse | None"]

DETECTORS: list[str] = [
    "mlxvlm.retrieval.colvision:detect",  # ColQwen2, ColPali (model_type colqwen2, colpali)
    "mlxvlm.retrieval.qwen3_vl_embedding:detect",  # Qwen3-VL-Embedding (qwen3_vl + modules.json)
    "mlxvlm.retrieval.qwen3_vl_reranker:detect",  # Qwen3-VL-Reranker (qwen3_vl + modules.json)
]


def detector(spec: str) -> Detector:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def detect_use(config: dict, model_path: Path) -> RetrievalUse | None:
    """The retrieval use of the checkpoint at ``model_path`` (None: a generative model)."""
    for spec in DETECTORS:
        use = detector(spec)(config, Path(model_path))
        if use is not None:
            return use
    return None
