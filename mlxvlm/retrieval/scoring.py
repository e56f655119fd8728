"""How vectors are compared: numpy only, so that the interface (``use.py``) and every
entry point share one definition."""

from __future__ import annotations

import numpy as np


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """Late interaction (ColBERT's MaxSim): for each of the query's token vectors
    ``[n, dim]`` its best dot product with the document's ``[m, dim]``, summed.

    Over the real tokens of each: transformers' ``score_retrieval`` pads a batch of
    documents with zero vectors, which adds a 0 to each maximum for the shorter ones;
    scored one pair at a time (as here) it gives the same number as this."""
    similarities = query.astype(np.float32) @ document.astype(np.float32).T
    return float(similarities.max(axis=1).sum())


def dot(query: np.ndarray, document: np.ndarray) -> float:
    """Single-vector similarity: the vectors are normalized, so this is their cosine."""
    return float(np.dot(query.astype(np.float32), document.astype(np.float32)))
