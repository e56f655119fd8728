"""What a loaded model does for retrieval besides (or instead of) generating: its
"retrieval use". ``mlxvlm.load`` asks the detectors of ``retrieval/detection.py`` for one
and keeps it as ``model.retrieval`` (None: a generative model); the Python API
(``retrieval/api.py``), the server's ``/v1/embeddings`` and ``/v1/rerank`` and the
``mlxvlm.embed`` command reach a model's retrieval only through this interface.

A use is one of three kinds:

- ``multi_vector``: one vector per token (ColPali, ColQwen2), scored by late interaction
  (MaxSim, ``scoring.maxsim``);
- ``single_vector``: one normalized vector per input (Qwen3-VL-Embedding), scored by the
  dot product of the query's and a document's vectors;
- ``reranker``: no vectors, a relevance score per (query, document) pair
  (Qwen3-VL-Reranker).

This module imports nothing of mlxvlm but ``retrieval/scoring.py`` (numpy alone): the
family contract names its type (``VisionLanguageModel.retrieval``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Sequence

import numpy as np

if TYPE_CHECKING:  # for the annotations only
    from PIL import Image

Kind = Literal["multi_vector", "single_vector", "reranker"]
KINDS: tuple[Kind, ...] = ("multi_vector", "single_vector", "reranker")


@dataclass(frozen=True)
class RetrievalInput:
    """One query or document, normalised by ``retrieval/inputs.py``: its text, its image
    (already loaded under the caller's media policy: upright RGB), or both."""

    text: str | None = None
    image: "Image.Image | None" = None

    def __post_init__(self):
        if self.text is None and self.image is None:
            raise ValueError("a retrieval input needs a text, an image or both")


@dataclass
class Encoded:
    """What ``RetrievalUse.embed`` returns for one batch, input by input: float32
    ``[tokens_i, dim]`` arrays (multi_vector) or ``[dim]`` arrays (single_vector), and
    how many prompt tokens each input took (the server's ``usage``)."""

    vectors: list[np.ndarray]
    tokens: list[int]


@dataclass
class Scored:
    """What ``RetrievalUse.score`` returns: one relevance score per document, in the
    documents' order, and the prompt tokens the scoring read (query and documents)."""

    scores: list[float]
    tokens: int = 0
    # How many forward passes of the model it took (for progress); informative only.
    passes: int = field(default=0, compare=False)


class RetrievalUse:
    """Base class of every retrieval use. A use holds what it read from the checkpoint
    (prompts, instruction defaults, token ids), never the model: the model and its
    processor are passed to each call, so the use may live on the model
    (``model.retrieval``) without a reference cycle.

    Subclasses set ``kind`` and implement ``embed`` (vector kinds) or ``score``
    (rerankers); vector kinds get ``score`` from ``embed``. Every call gets one batch,
    already cut by the API to at most ``batch_size`` inputs (the API shows progress
    between calls); inputs are ``RetrievalInput``s.
    """

    kind: ClassVar[Kind]
    # Inputs per forward pass the API cuts a long list into (``batch_size=`` overrides).
    batch_size: ClassVar[int] = 8
    # Whether an input may hold a text and an image together (ColPali and ColQwen2
    # take either a text query or a page image, as transformers' processors do).
    takes_text_with_image: ClassVar[bool] = True
    # Whether the use reads the model's output head (a reranker's "yes"/"no" logits):
    # a checkpoint whose untied head is absent loads only where it does not.
    needs_output_head: ClassVar[bool] = False

    def embed(self, model: Any, processor: Any, items: Sequence[RetrievalInput],
              instruction: str | None = None) -> Encoded:
        """One forward pass (or a few) over ``items``: their vectors, in order.
        ``instruction``: a task description for the models that take one (None: the
        model's default; ignored by those that take none)."""
        raise NotImplementedError(f"a {self.kind} model does not embed; it scores pairs")

    def embed_query(self, model: Any, processor: Any, items: Sequence[RetrievalInput],
                    instruction: str | None = None) -> Encoded:
        """``items`` embedded as queries, for ``score``: by default as any input. A model
        whose queries and documents differ (an instruction for queries only) overrides."""
        return self.embed(model, processor, items, instruction)

    def embed_documents(self, model: Any, processor: Any, items: Sequence[RetrievalInput],
                        instruction: str | None = None) -> Encoded:
        """``items`` embedded as documents, for ``score``: by default as any input."""
        return self.embed(model, processor, items, instruction)

    def similarity(self, query: np.ndarray, document: np.ndarray) -> float:
        """The score of one query's vectors against one document's: MaxSim for
        multi_vector uses, the dot product for single_vector ones."""
        from mlxvlm.retrieval.scoring import dot, maxsim

        return maxsim(query, document) if self.kind == "multi_vector" else dot(query, document)

    def score(self, model: Any, processor: Any, query: RetrievalInput,
              documents: Sequence[RetrievalInput], instruction: str | None = None) -> Scored:
        """One score per document of ``documents`` (one batch) against ``query``.
        Vector kinds embed both and compare them (``similarity``); a reranker
        overrides this."""
        if self.kind == "reranker":
            raise NotImplementedError("a reranker implements score")
        q = self.embed_query(model, processor, [query], instruction)
        d = self.embed_documents(model, processor, documents, instruction)
        scores = [self.similarity(q.vectors[0], v) for v in d.vectors]
        return Scored(scores, q.tokens[0] + sum(d.tokens), passes=2)


# What a model serves, by its use (None: a generative model): the server's /v1/models
# and the routes a model answers read this.
CAPABILITIES: dict[str | None, tuple[str, ...]] = {
    None: ("chat",),
    "multi_vector": ("embed", "rerank"),
    "single_vector": ("embed", "rerank"),
    "reranker": ("rerank",),
}


def capabilities(use: RetrievalUse | None) -> tuple[str, ...]:
    """``chat``, ``embed``, ``rerank``: what a model with ``use`` does."""
    return CAPABILITIES[None if use is None else use.kind]
