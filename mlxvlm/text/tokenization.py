"""The streaming detokenizer and stop ids that generation needs, attached to a processor.

Every path (``generate``, the batching engine, the server, the UI) gets its detokenizer
from ``generation_tokenizer(processor).detokenizer``: mlx-lm's TokenizerWrapper (which
hands out a fresh copy per sequence) carrying mlxvlm's ``StreamingDetokenizer``, whose
text is exactly ``tokenizer.decode(ids, skip_special_tokens=True)`` (see
mlxvlm/text/detokenizer.py; mlx-lm's own detokenizers show byte 0x00 as "Ā" and special or
out-of-vocabulary ids as "!").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxvlm.text.detokenizer import StreamingDetokenizer


def attach_generation_tokenizer(processor: Any, model_path: Path, eos_token_ids: set[int]):
    # model_path is kept for callers; the decoder is read from the loaded tokenizer itself.
    processor.detokenizer_tokenizer = TokenizerWrapper(
        processor.tokenizer, StreamingDetokenizer, eos_token_ids=eos_token_ids
    )
    processor.eos_token_ids = set(eos_token_ids)
    return processor


def generation_tokenizer(processor: Any) -> TokenizerWrapper:
    """The processor's TokenizerWrapper (attached by ``load``), made on first use for a
    processor the caller built by hand."""
    wrapper = getattr(processor, "detokenizer_tokenizer", None)
    if wrapper is None:
        tokenizer = getattr(processor, "tokenizer", processor)
        wrapper = TokenizerWrapper(tokenizer, StreamingDetokenizer)
        processor.detokenizer_tokenizer = wrapper
    return wrapper
