"""Token log-probabilities in OpenAI's shape: each token's text, its UTF-8 bytes (a token
may hold part of a character) and its log-probability, with the top alternatives."""

from __future__ import annotations

from typing import Any

from mlx_lm import tokenizer_utils
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from mlxvlm.batching import BatchStep

_SPM_SPACE = "\u2581".encode()


class TokenBytes:
    """The raw bytes of single tokens, from the tables of mlx-lm's streaming detokenizer
    (byte-level BPE and SentencePiece), else from decoding the token alone."""

    def __init__(self, tokenizer_wrapper: Any):
        self.tokenizer = tokenizer_wrapper
        detokenizer = tokenizer_wrapper.detokenizer
        self.tokenmap = getattr(detokenizer, "tokenmap", None)
        self.kind = type(detokenizer)
        self.own_bytes = getattr(detokenizer, "token_bytes", None)  # mlxvlm's detokenizer
        byte_decoder = getattr(tokenizer_utils, "_byte_decoder", None)  # private: guarded
        self.byte_decoder = byte_decoder() if byte_decoder is not None else None

    def __call__(self, token: int) -> bytes:
        raw = self.own_bytes(token) if self.own_bytes is not None else None
        if raw is not None:
            return raw
        if self.tokenmap is not None and 0 <= token < len(self.tokenmap):
            piece = self.tokenmap[token]
            if issubclass(self.kind, SPMStreamingDetokenizer) and isinstance(piece, bytes):
                return piece.replace(_SPM_SPACE, b" ")
            if (
                issubclass(self.kind, BPEStreamingDetokenizer)
                and self.byte_decoder is not None
                and all(c in self.byte_decoder for c in piece)
            ):
                return bytes(self.byte_decoder[c] for c in piece)
        return self.tokenizer.decode([token]).encode("utf-8")


def _entry(token_bytes: TokenBytes, token: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(token)
    return {
        "token": raw.decode("utf-8", errors="replace"),
        "logprob": logprob,
        "bytes": list(raw),
    }


def logprob_content(token_bytes: TokenBytes, step: BatchStep) -> dict[str, Any]:
    """One element of ``choices[].logprobs.content``."""
    entry = _entry(token_bytes, step.token, step.logprob)
    entry["top_logprobs"] = [
        _entry(token_bytes, token, logprob) for token, logprob in (step.top_logprobs or [])
    ]
    return entry
