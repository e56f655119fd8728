"""``POST /v1/embeddings`` (OpenAI's shape) and ``POST /v1/rerank`` (vLLM's and
llama-server's shape) for retrieval models, under the chat routes' keys, body limit,
admission and media rules.

A multi-vector model (ColPali, ColQwen2) answers each input with its list of token
vectors: ``embedding`` is a list of ``[dim]`` lists with ``encoding_format: float``, and
the ``[tokens, dim]`` float32 array's bytes, row after row, with ``base64``; ``shape``
gives ``[tokens, dim]`` either way."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Request

from mlxvlm.errors import MlxvlmError
from mlxvlm.retrieval.api import encode, retrieval_use, score_documents
from mlxvlm.retrieval.inputs import retrieval_inputs
from mlxvlm.server.answering import as_api_error
from mlxvlm.server.deps import body_dependencies
from mlxvlm.server.errors import APIError
from mlxvlm.server.lifetime import RequestLifetime
from mlxvlm.server.retrieval_schemas import (
    MAX_INPUTS,
    EmbeddingsRequest,
    RerankRequest,
    RetrievalItem,
)
from mlxvlm.server.service import GenerationService

router = APIRouter()

embeddings_request, embeddings_service = body_dependencies(EmbeddingsRequest, "embed")
rerank_request, rerank_service = body_dependencies(RerankRequest, "rerank")


def plain(item: str | RetrievalItem) -> str | dict:
    """A request's item as ``mlxvlm.retrieval.inputs`` takes it."""
    return item if isinstance(item, str) else item.model_dump(exclude_none=True)


def has_images(items: list) -> bool:
    return any(isinstance(item, RetrievalItem) and item.image is not None for item in items)


async def run(request: Request, service: GenerationService, work, media: bool, param: str):
    """``work(policy)`` through the service, within an admission slot; the input errors
    it raises as 400s (a passed limit counted as the chat routes count it)."""
    with RequestLifetime(service, request) as life:
        try:
            return await life.until_disconnect(service.run_retrieval(work, media))
        except (MlxvlmError, ValueError) as error:
            limit = getattr(error, "limit", None)
            if limit is not None:
                service.counters.refuse(limit)
            raise as_api_error(error, param) from error


def encoded_vector(vector: np.ndarray, encoding_format: str) -> Any:
    vector = np.asarray(vector, dtype=np.float32)
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@router.post("/v1/embeddings")
async def embeddings(request: Request,
                     body: Annotated[EmbeddingsRequest, Depends(embeddings_request)],
                     service: Annotated[GenerationService, Depends(embeddings_service)]) -> dict:
    items = body.input if isinstance(body.input, list) else [body.input]
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(items)} items; at most {MAX_INPUTS} per "
                       "request", param="input")
    if body.dimensions is not None:
        raise APIError(400, "dimensions is not supported: this model's vectors have one "
                       "size; leave it out", param="dimensions")
    model, processor = service.model, service.processor

    def work(policy):
        use = retrieval_use(model)
        inputs = retrieval_inputs([plain(i) for i in items], use, "input", policy)
        with service.model_lock:
            return use, encode(model, processor, inputs, instruction=body.instruction,
                               progress=False)

    use, encoded = await run(request, service, work, has_images(items), "input")
    multi = use.kind == "multi_vector"
    data = []
    for index, vector in enumerate(encoded.vectors):
        entry = {"object": "embedding", "index": index,
                 "embedding": encoded_vector(vector, body.encoding_format)}
        if multi:
            entry["shape"] = list(vector.shape)
        data.append(entry)
    tokens = sum(encoded.tokens)
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(request: Request, body: Annotated[RerankRequest, Depends(rerank_request)],
                 service: Annotated[GenerationService, Depends(rerank_service)]) -> dict:
    model, processor = service.model, service.processor

    def work(policy):
        with service.model_lock:
            return score_documents(model, processor, plain(body.query),
                                   [plain(d) for d in body.documents], body.instruction,
                                   progress=False, policy=policy)

    scores, tokens = await run(request, service, work,
                               has_images([body.query, *body.documents]), "documents")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]
    results = []
    for index in order:
        result: dict = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            document = plain(body.documents[index])
            result["document"] = {"text": document} if isinstance(document, str) else document
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex}", "object": "rerank", "created": int(time.time()),
            "model": body.model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
