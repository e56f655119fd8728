"""The streaming detokenizer and stop ids that generation needs, attached to a processor.

mlx-lm's TokenizerWrapper picks the fastest correct streaming detokenizer (BPE, SentencePiece
or the naive one) from the decoder in tokenizer.json; we reuse its choice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_lm import tokenizer_utils
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)


def detokenizer_class(model_path: Path):
    tokenizer_file = model_path / "tokenizer.json"
    if not tokenizer_file.exists():
        return NaiveStreamingDetokenizer
    decoder = json.loads(tokenizer_file.read_text(encoding="utf-8")).get("decoder")
    if not decoder:
        return NaiveStreamingDetokenizer
    # mlx-lm's own predicates over the decoder spec (private, so guard against renames).
    is_spm = getattr(tokenizer_utils, "_is_spm_decoder", None)
    is_bpe = getattr(tokenizer_utils, "_is_bpe_decoder", None)
    if is_spm is not None and is_spm(decoder):
        return SPMStreamingDetokenizer
    if is_bpe is not None and is_bpe(decoder):
        return BPEStreamingDetokenizer
    return NaiveStreamingDetokenizer


def attach_generation_tokenizer(processor: Any, model_path: Path, eos_token_ids: set[int]):
    processor.detokenizer_tokenizer = TokenizerWrapper(
        processor.tokenizer, detokenizer_class(model_path), eos_token_ids=eos_token_ids
    )
    processor.eos_token_ids = set(eos_token_ids)
    return processor


def generation_tokenizer(processor: Any) -> TokenizerWrapper:
    """The processor's TokenizerWrapper (attached by ``load``), made on first use for a
    processor the caller built by hand."""
    wrapper = getattr(processor, "detokenizer_tokenizer", None)
    if wrapper is None:
        tokenizer = getattr(processor, "tokenizer", processor)
        wrapper = TokenizerWrapper(tokenizer, NaiveStreamingDetokenizer)
        processor.detokenizer_tokenizer = wrapper
    return wrapper
