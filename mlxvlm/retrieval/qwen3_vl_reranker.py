"""Qwen3-VL-Reranker (``Qwen/Qwen3-VL-Reranker-2B``, ``-8B``): a relevance score per
(query, document) pair, a ``qwen3_vl`` checkpoint asked "yes" or "no".

As the model's official script (``scripts/qwen3_vl_reranker.py``) defines it:

- the input is a chat: a fixed system turn (``SYSTEM``), and a user turn of
  ``"<Instruct>: " + instruction`` (default ``DEFAULT_INSTRUCTION``), ``"<Query>:"``, the
  query's images then its text, ``"\\n<Document>:"``, the document's images then its
  text; the template's generation prompt follows;
- the score is sigmoid(logit("yes") - logit("no")) at the last token: the script's
  one-row linear layer of ``lm_head[yes] - lm_head[no]``. sentence-transformers'
  ``LogitScore`` module (``modules.json``) computes the same difference, before the
  sigmoid, from the token ids its config names.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from mlxvlm.errors import MlxvlmError
from mlxvlm.retrieval.qwen3_vl_batch import Conversation, last_token_states
from mlxvlm.retrieval.sentence_transformers_files import named, st_modules
from mlxvlm.retrieval.use import RetrievalInput, RetrievalUse, Scored
from mlxvlm.text.tokenization import tokenizer_of

SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the '
          'Instruct provided. Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."


def _parts(prefix: str, item: RetrievalInput) -> tuple[list[dict], list]:
    content = [{"type": "text", "text": prefix}]
    if item.image is not None:
        content.append({"type": "image"})
    if item.text is not None:
        content.append({"type": "text", "text": item.text})
    return content, [item.image] if item.image is not None else []


def conversation(query: RetrievalInput, document: RetrievalInput,
                 instruction: str | None) -> Conversation:
    query_parts, query_images = _parts("<Query>:", query)
    document_parts, document_images = _parts("\n<Document>:", document)
    content = [{"type": "text", "text": "<Instruct>: " + (instruction or DEFAULT_INSTRUCTION)},
               *query_parts, *document_parts]
    messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {"role": "user", "content": content}]
    return Conversation(messages, query_images + document_images)


class Qwen3VLReranker(RetrievalUse):
    kind = "reranker"
    needs_output_head = True

    def __init__(self, yes_id: int | None = None, no_id: int | None = None):
        # From sentence-transformers' LogitScore config where the checkpoint has one;
        # else looked up in the tokenizer's vocabulary, as the script does.
        self.yes_id, self.no_id = yes_id, no_id

    def answer_ids(self, processor: Any) -> tuple[int, int]:
        if self.yes_id is not None and self.no_id is not None:
            return self.yes_id, self.no_id
        vocabulary = tokenizer_of(processor).get_vocab()
        if "yes" not in vocabulary or "no" not in vocabulary:
            raise MlxvlmError("this reranker's tokenizer has no 'yes' and 'no' tokens to score with")
        return vocabulary["yes"], vocabulary["no"]

    def score(self, model: Any, processor: Any, query: RetrievalInput,
              documents: Sequence[RetrievalInput], instruction: str | None = None) -> Scored:
        yes, no = self.answer_ids(processor)
        last, tokens = last_token_states(
            model, processor, [conversation(query, d, instruction) for d in documents])
        logits = model.language_model.logits(last).astype(mx.float32)
        scores = mx.sigmoid(logits[:, yes] - logits[:, no])
        return Scored(scores.tolist(), sum(tokens), passes=1)


def detect(config: dict, model_path) -> Qwen3VLReranker | None:
    """A ``qwen3_vl`` checkpoint whose sentence-transformers modules end in a
    ``LogitScore`` (the Hub's Qwen3-VL-Reranker repos), scoring with the true and false
    token ids its config names; without ``modules.json``, one whose Hub name says
    Qwen3-VL-Reranker."""
    if config.get("model_type") != "qwen3_vl":
        return None
    modules = st_modules(model_path)
    for name, settings in modules:
        if name == "LogitScore":
            yes, no = (settings or {}).get("true_token_id"), (settings or {}).get("false_token_id")
            if isinstance(yes, int) and isinstance(no, int):
                return Qwen3VLReranker(yes, no)
            return Qwen3VLReranker()  # its config lost: "yes" and "no" from the vocabulary
    if modules:  # another sentence-transformers model (an embedder)
        return None
    return Qwen3VLReranker() if named(model_path, "Qwen3-VL-Reranker") else None
