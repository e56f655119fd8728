"""The bodies of ``POST /v1/embeddings`` (OpenAI's shape) and ``POST /v1/rerank`` (the
shape vLLM, llama-server, Jina and Cohere share)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from mlxvlm.server.schemas import StrictModel

# The most inputs one request may embed, or documents it may rerank (OpenAI's limit for
# embeddings is 2048 inputs).
MAX_INPUTS = 2048


class RetrievalItem(StrictModel):
    """One input: ``{"text": ...}``, ``{"image": data URL or http(s) URL}`` or both
    (read under the server's media rules)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    text: str | None = None
    image: str | None = Field(default=None, min_length=1)


Item = str | RetrievalItem


class EmbeddingsRequest(StrictModel):
    model: str
    input: Item | list[Item] = Field(union_mode="left_to_right")
    encoding_format: Literal["float", "base64"] = "float"
    # OpenAI's: a shorter vector; none of these models is trained for it.
    dimensions: int | None = None
    user: str | None = None
    # The task description for the models that take one (Qwen3-VL-Embedding).
    instruction: str | None = None


class RerankRequest(StrictModel):
    model: str
    query: Item
    documents: list[Item] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    instruction: str | None = None
