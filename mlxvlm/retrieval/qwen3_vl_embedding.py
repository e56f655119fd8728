"""Qwen3-VL-Embedding (``Qwen/Qwen3-VL-Embedding-2B``, ``-8B``): one normalized vector
per input, a ``qwen3_vl`` checkpoint read at its last token.

As the model's official script (``scripts/qwen3_vl_embedding.py``) and its
sentence-transformers files (``modules.json``: Transformer, Pooling ``lasttoken``,
Normalize) define it:

- the input is a chat: a system turn holding the instruction (default "Represent the
  user's input.", and an instruction that does not end in punctuation gets a "."), and a
  user turn holding the input's images, then its text; the template's generation prompt
  follows;
- the vector is the decoder's final hidden state (after its norm, before the head) at
  the last token, L2-normalized.

Queries take the caller's instruction; documents are embedded with the default, as the
model card's retrieval example does.
"""

from __future__ import annotations

import unicodedata
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from mlxvlm.retrieval.qwen3_vl_batch import Conversation, last_token_states
from mlxvlm.retrieval.sentence_transformers_files import named, pools_last_token, st_modules
from mlxvlm.retrieval.use import Encoded, RetrievalInput, RetrievalUse

DEFAULT_INSTRUCTION = "Represent the user's input."


def system_instruction(instruction: str | None) -> str:
    """The system turn's text: the instruction, ending in punctuation, or the default."""
    instruction = (instruction or "").strip()
    if not instruction:
        return DEFAULT_INSTRUCTION
    if not unicodedata.category(instruction[-1]).startswith("P"):
        instruction += "."
    return instruction


def conversation(item: RetrievalInput, instruction: str | None) -> Conversation:
    content = []
    if item.image is not None:
        content.append({"type": "image"})
    if item.text is not None:
        content.append({"type": "text", "text": item.text})
    messages = [
        {"role": "system", "content": [{"type": "text", "text": system_instruction(instruction)}]},
        {"role": "user", "content": content},
    ]
    return Conversation(messages, [item.image] if item.image is not None else [])


class Qwen3VLEmbedding(RetrievalUse):
    kind = "single_vector"

    def embed(self, model: Any, processor: Any, items: Sequence[RetrievalInput],
              instruction: str | None = None) -> Encoded:
        last, tokens = last_token_states(
            model, processor, [conversation(item, instruction) for item in items])
        # F.normalize's eps: a zero vector stays zero instead of becoming NaN.
        norms = mx.maximum(mx.linalg.norm(last, axis=-1, keepdims=True), 1e-12)
        vectors = np.asarray(last / norms)
        return Encoded(list(vectors), tokens)

    def embed_documents(self, model: Any, processor: Any, items: Sequence[RetrievalInput],
                        instruction: str | None = None) -> Encoded:
        return self.embed(model, processor, items, None)


def detect(config: dict, model_path) -> Qwen3VLEmbedding | None:
    """A ``qwen3_vl`` checkpoint whose sentence-transformers modules pool the last token
    and normalize (the Hub's Qwen3-VL-Embedding repos); where ``modules.json`` or its
    Pooling config is missing, one whose Hub name says Qwen3-VL-Embedding."""
    if config.get("model_type") != "qwen3_vl":
        return None
    modules = st_modules(model_path)
    pooling = [settings for name, settings in modules if name == "Pooling"]
    if pooling and pooling[0] is not None:
        normalizes = any(name == "Normalize" for name, _ in modules)
        return Qwen3VLEmbedding() if pools_last_token(pooling[0]) and normalizes else None
    if modules and not pooling:  # another sentence-transformers model (a reranker)
        return None
    return Qwen3VLEmbedding() if named(model_path, "Qwen3-VL-Embedding") else None
