"""What a draft model and its target may hand each other. Token ids index embedding
tables, and MLX's gather does not check its indices: an id past a table's last row reads
the memory after it, silently. A draft and its target may share a tokenizer yet hold
tables of different sizes (Hub pairs padded differently: Qwen2-VL-7B's table has 152064
rows, 2B's 151936), so:

- a draft is never fed an id its table lacks: once the sequence holds one (the prompt,
  or a token the target wrote), the draft stops drafting for that sequence, which then
  decodes plainly (re-syncing the draft later would need its cache rebuilt);
- a target's verify pass is never fed a draft id its table lacks: each draft is cut at
  its first such id (the target, with no logit for it, would reject it anyway).

Pairs whose tokenizers differ (a token with another id) are refused when the draft is
loaded; a mere difference in padding rows is not.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.nn as nn
import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.text.tokenization import tokenizer_of

# What a text model calls its token table (mlx-lm's families and mlxvlm's); the first
# name found wins, so a position table (``wpe``) or Gemma 3n's per-layer table
# (``embed_tokens_per_layer``, which masks ids past it itself) is never taken for it.
TOKEN_TABLE_NAMES = ("embed_tokens", "tok_embeddings", "wte", "word_embeddings",
                     "token_embeddings", "embed_in", "embeddings", "embedding", "embed")


def _rows(module: Any) -> int | None:
    """A lookup table's row count: quantized tables (nn.QuantizedEmbedding, the CPU
    kernels' copy) and tables left on disk (GatheredEmbedding) say it, a plain
    nn.Embedding's weight has it."""
    if isinstance(module, nn.QuantizedEmbedding) or hasattr(module, "num_embeddings"):
        return int(module.num_embeddings)
    if isinstance(module, nn.Embedding):
        return int(module.weight.shape[0])
    return None


def embedding_rows(model: nn.Module) -> int:
    """How many token ids ``model`` can be fed: the rows of the table its text model
    looks input ids up in (under ``language_model`` for a vision-language family; tied
    to the output head or not)."""
    modules = model.named_modules()
    for name in TOKEN_TABLE_NAMES:
        found = [(path, rows) for path, module in modules
                 if path.rsplit(".", 1)[-1] == name and (rows := _rows(module)) is not None]
        if found:
            # The text model's own table before a talker's or an encoder's.
            found.sort(key=lambda f: (not f[0].startswith("language_model."), f[0].count(".")))
            return found[0][1]
    raise MlxvlmError(f"cannot find the token embedding table of {type(model).__module__}."
                      f"{type(model).__name__} (a draft's ids must be checked against it)")


def in_table(ids: Sequence[int], rows: int) -> int:
    """How many of ``ids``, from the first, a table of ``rows`` rows holds."""
    outside = np.flatnonzero(np.asarray(ids, dtype=np.int64) >= rows)
    return int(outside[0]) if outside.size else len(ids)


def check_same_tokenizer(target_processor: Any, draft_processor: Any) -> None:
    """Refuse a draft whose tokenizer gives a token another id than the target's (ids
    only one of them has, as padding or added tokens at the end, are fine)."""
    target = tokenizer_of(target_processor).get_vocab()
    draft = tokenizer_of(draft_processor).get_vocab()
    target_tokens = {i: t for t, i in target.items()}
    for token, i in draft.items():
        if target.get(token, i) != i:
            where = f"the model has it as id {target[token]}"
        elif target_tokens.get(i, token) != token:
            where = f"the model has {target_tokens[i]!r} there"
        else:
            continue
        raise MlxvlmError(f"the draft model's tokenizer differs from the model's: the draft "
                          f"has {token!r} as id {i}, {where} (a draft model must share the "
                          f"model's tokenizer)")
