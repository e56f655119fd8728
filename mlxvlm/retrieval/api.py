"""``mlxvlm.embed`` and ``mlxvlm.rerank``: a loaded model's retrieval use over lists of
any length, cut into batches of ``batch_size`` inputs per forward pass, with a progress
bar for long lists."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.media.policy import MediaPolicy
from mlxvlm.retrieval.inputs import retrieval_input, retrieval_inputs, check_takes
from mlxvlm.retrieval.use import Encoded, RetrievalInput, RetrievalUse

# Lists at least this long show a progress bar by default (``progress=None``).
PROGRESS_FROM = 32


class NotARetrievalModelError(MlxvlmError, ValueError):
    """The model has no retrieval use (a chat model), or not the one asked for."""


def retrieval_use(model: Any, action: str = "embed") -> RetrievalUse:
    """The model's retrieval use, or a one-line refusal naming what the model is for."""
    use = getattr(model, "retrieval", None)
    if use is None:
        raise NotARetrievalModelError(
            f"this model generates text and has no retrieval use; {action} needs an "
            "embedding model (ColQwen2, ColPali, Qwen3-VL-Embedding) or a reranker")
    if action == "embed" and use.kind == "reranker":
        raise NotARetrievalModelError(
            "this model is a reranker: it scores (query, document) pairs "
            "(mlxvlm.rerank) and gives no embeddings")
    return use


class RetrievalOnlyModelError(MlxvlmError, ValueError):
    """A retrieval model (an embedding model, a reranker) asked to generate."""


def check_generates(model: Any) -> None:
    """Refuse to generate with a retrieval model: its head (if any) was never trained to
    write, so an answer would be noise."""
    use = getattr(model, "retrieval", None)
    if use is not None:
        what = "a reranker" if use.kind == "reranker" else "an embedding model"
        raise RetrievalOnlyModelError(
            f"this model is {what} ({use.kind}) and does not generate text; use "
            f"mlxvlm.{'rerank' if use.kind == 'reranker' else 'embed'} instead")


def batches(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


@contextmanager
def progress_bar(total: int, show: bool | None, desc: str):
    """tqdm's bar on stderr (``show`` None: for lists of ``PROGRESS_FROM`` or more)."""
    show = total >= PROGRESS_FROM if show is None else show
    if not show:
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="input", file=sys.stderr) as bar:
        yield bar.update


def encode(model: Any, processor: Any, items: Sequence[RetrievalInput], *,
           role: str = "any", instruction: str | None = None,
           batch_size: int | None = None, progress: bool | None = None) -> Encoded:
    """``items`` (normalised) through the model's use in batches; ``role``: "query",
    "document" or "any" (which of the use's ``embed_*`` runs)."""
    use = retrieval_use(model)
    method = {"query": use.embed_query, "document": use.embed_documents,
              "any": use.embed}[role]
    size = check_batch_size(batch_size or use.batch_size)
    vectors, tokens = [], []
    with progress_bar(len(items), progress, "embedding") as advance:
        for batch in batches(items, size):
            encoded = method(model, processor, batch, instruction)
            vectors += encoded.vectors
            tokens += encoded.tokens
            advance(len(batch))
    return Encoded(vectors, tokens)


def check_batch_size(size: int) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise MlxvlmError(f"batch_size must be a positive integer, got {size!r}")
    return size


def embed(model: Any, processor: Any, inputs: Any, instruction: str | None = None, *,
          batch_size: int | None = None, progress: bool | None = None,
          policy: MediaPolicy | None = None):
    """Embed ``inputs`` (one input or a list; each a string, ``{"text": ...}``,
    ``{"image": path | URL | PIL}``, both, or a PIL image) with a retrieval model.

    Returns a float32 array ``[n, dim]`` for a single-vector model, and a list of
    ``[tokens_i, dim]`` arrays (one vector per token) for a multi-vector one.
    ``instruction``: the task description for models that take one (Qwen3-VL-Embedding);
    ``batch_size``: inputs per forward pass (default: the model's); ``progress``: a
    progress bar on stderr (default: for lists of 32 or more); ``policy``: where images
    may come from (``mlxvlm.media.MediaPolicy``; default: anywhere)."""
    use = retrieval_use(model)
    items = retrieval_inputs(inputs, use, policy=policy)
    encoded = encode(model, processor, items, instruction=instruction,
                     batch_size=batch_size, progress=progress)
    if use.kind == "multi_vector":
        return encoded.vectors
    return np.stack(encoded.vectors).astype(np.float32)


def rerank(model: Any, processor: Any, query: Any, documents: Any,
           instruction: str | None = None, *, batch_size: int | None = None,
           progress: bool | None = None, policy: MediaPolicy | None = None) -> list[float]:
    """One relevance score per document of ``documents`` for ``query`` (inputs as
    ``embed`` takes them), in the documents' order: MaxSim for a multi-vector model, the
    dot product of normalized vectors for a single-vector one, the reranker's score for
    a reranker."""
    return score_documents(model, processor, query, documents, instruction,
                           batch_size=batch_size, progress=progress, policy=policy)[0]


def score_documents(model: Any, processor: Any, query: Any, documents: Any,
                    instruction: str | None = None, *, batch_size: int | None = None,
                    progress: bool | None = None,
                    policy: MediaPolicy | None = None) -> tuple[list[float], int]:
    """``rerank``'s scores and the prompt tokens read (the server's ``usage``)."""
    use = retrieval_use(model, "rerank")
    query_item = retrieval_input(query, "query", policy)
    check_takes(query_item, use, "query")
    items = retrieval_inputs(documents, use, "documents", policy)
    size = check_batch_size(batch_size or use.batch_size)
    if use.kind == "reranker":
        scores, tokens = [], 0
        with progress_bar(len(items), progress, "reranking") as advance:
            for batch in batches(items, size):
                scored = use.score(model, processor, query_item, batch, instruction)
                scores += scored.scores
                tokens += scored.tokens
                advance(len(batch))
        return scores, tokens
    q = encode(model, processor, [query_item], role="query", instruction=instruction,
               batch_size=size, progress=False)
    d = encode(model, processor, items, role="document", instruction=instruction,
               batch_size=size, progress=progress)
    scores = [use.similarity(q.vectors[0], vectors) for vectors in d.vectors]
    return scores, q.tokens[0] + sum(d.tokens)
