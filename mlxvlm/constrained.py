"""Constrained decoding: a grammar (a JSON schema, any JSON object) that every sampled
token must keep the answer within, applied as one more logits processor of the sampling
step, so that it works alike in ``generate``, the batching engine, the server and the UI.

The grammar engine is llguidance (the ``structured`` extra): it compiles JSON schemas
itself and computes each step's allowed tokens from the tokenizer's own vocabulary in
microseconds. Its tokens are the checkpoint's tokenizer's; ids past them (a head padded
beyond the vocabulary) are never allowed. Once the grammar is complete only the end of
the answer (the checkpoint's end-of-sequence ids) is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError


class ConstraintError(MlxvlmError, ValueError):
    """A grammar or schema that cannot be used (invalid, or llguidance is missing)."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ConstraintError(
            "structured output needs llguidance: pip install 'mlxvlm[structured]'") from None
    return llguidance


# llguidance's tokenizers by (transformers tokenizer id, end ids), the tokenizer kept
# beside its own so that the id stays its own; not on the tokenizer itself, which must
# stay picklable.
_GRAMMAR_TOKENIZERS: dict[tuple[int, tuple[int, ...]], tuple[Any, Any]] = {}


def grammar_tokenizer(tokenizer: Any, eos_token_ids: Iterable[int]) -> Any:
    """llguidance's view of ``tokenizer`` (a transformers fast tokenizer), ending answers
    with ``eos_token_ids``; built once per tokenizer (it costs about a second)."""
    eos = tuple(sorted(set(eos_token_ids)))
    key = (id(tokenizer), eos)
    kept = _GRAMMAR_TOKENIZERS.get(key)
    if kept is not None and kept[0] is tokenizer:
        return kept[1]
    llguidance = _llguidance()
    try:
        built = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos) or None)
    except ValueError as error:
        raise ConstraintError(f"structured output needs a fast tokenizer: {error}") from None
    _GRAMMAR_TOKENIZERS[key] = (tokenizer, built)
    return built


# How much longer one freely chosen token can make the closing path: a UTF-8 lead byte
# needs up to 3 more bytes, a "\u" escape 4 hex digits, before the answer can close.
_FREE_TOKEN_SLACK = 6
# The token budget from which a sequence starts to check that it can still close its
# answer in time (a check per token costs one simulated closing).
CLOSING_HORIZON = 256
# The bytes that end a structure, which the closing path prefers, and the quote, which
# outside a string opens one (so it is avoided there) and inside ends it (preferred,
# see ClosingPreference).
_QUOTE = -1e5  # outweighs any run of brackets a token can hold
_CLOSERS = {ord('"'): _QUOTE, ord("}"): 900.0, ord("]"): 900.0}


# Each grammar tokenizer's closing preference, computed once (keyed by the tokenizer's id,
# the tokenizer kept beside it so that the id stays its own).
_PREFERENCES: dict[int, tuple[Any, "ClosingPreference"]] = {}


@dataclass
class ClosingPreference:
    """A score per token for the closing path: tokens with more closing brackets and no
    quotes first, then shorter ones; whitespace, then tokens without text (special
    tokens) last. Where
    both a lone ``}`` and a lone ``]`` are allowed they are text (the answer is inside a
    string), and a token that begins with the quote that ends it comes first (a
    byte-level BPE has tokens like ``]]]]`` and ``","``, which would otherwise keep the
    string going, or open the next one)."""

    scores: np.ndarray
    quoted: np.ndarray  # tokens that begin with a quote
    brackets: list[int]  # the lone "}" and "]" tokens

    def choose(self, allowed: np.ndarray) -> int:
        scores = self.scores
        if len(self.brackets) == 2 and allowed[self.brackets].all():
            scores = np.where(self.quoted, scores + _INSIDE_STRING_QUOTE, scores)
        return int(np.argmax(np.where(allowed, scores, -np.inf)))


_WHITESPACE = -1e6
_NO_TEXT = -2e6
# Inside a string: a token that begins with the closing quote before any other, and its
# quote counted as closing, not opening.
_INSIDE_STRING_QUOTE = 1e7 - _QUOTE


def _closing_preference(lltokenizer: Any) -> ClosingPreference:
    # Tokens without text (special tokens) last but choosable: a grammar may need one (a
    # family's tool-call marker); -inf is left for the tokens the grammar does not allow.
    scores = np.full(lltokenizer.vocab_size, _NO_TEXT)
    quoted = np.zeros(lltokenizer.vocab_size, dtype=bool)
    brackets = []
    for token in range(lltokenizer.vocab_size):
        text = lltokenizer.decode_bytes([token])
        if text and not lltokenizer.is_special_token(token):
            scores[token] = sum(_CLOSERS.get(byte, 0.0) for byte in text) - len(text)
            if not text.strip():  # whitespace never closes anything (a grammar may
                scores[token] = _WHITESPACE  # allow it forever between tokens)
            quoted[token] = text.startswith(b'"')  # (a quote later may be escaped)
            if text in (b"}", b"]"):
                brackets.append(token)
    return ClosingPreference(scores, quoted, brackets[:2] if len(brackets) == 2 else [])


class GrammarConstraint:
    """A compiled grammar over one tokenizer; ``processor(max_tokens)`` gives each sequence
    its own matcher, as a logits processor ``(history, logits) -> logits``."""

    def __init__(self, grammar: str, lltokenizer: Any, description: str):
        llguidance = _llguidance()
        self.grammar = grammar
        self.lltokenizer = lltokenizer
        self.description = description
        problem = llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)
        if problem and not problem.startswith("WARNING"):
            raise ConstraintError(f"{description} cannot be used: {problem}")
        self._preference: ClosingPreference | None = None

    @property
    def preference(self) -> ClosingPreference:
        if self._preference is None:
            kept = _PREFERENCES.get(id(self.lltokenizer))
            if kept is None or kept[0] is not self.lltokenizer:
                kept = _PREFERENCES[id(self.lltokenizer)] = (
                    self.lltokenizer, _closing_preference(self.lltokenizer))
            self._preference = kept[1]
        return self._preference

    def processor(self, max_tokens: int) -> "GrammarProcessor":
        llguidance = _llguidance()
        matcher = llguidance.LLMatcher(self.lltokenizer, self.grammar, log_level=0)
        return GrammarProcessor(matcher, self, max_tokens)


def _allowed(matcher: Any, vocab_size: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                         bitorder="little")[:vocab_size].astype(bool)


class GrammarProcessor:
    """One sequence's matcher: it consumes each token fed back and masks the logits to the
    tokens the grammar allows next.

    An answer cut by the token budget would not be valid, so near the end of the budget
    the processor checks how many tokens its closing path (at each step the allowed
    token with the most closing bytes, see ``_closing_preference``) needs to complete
    the answer from here, simulated on a copy of the matcher; once the budget left is no
    more than that, it follows the closing path itself."""

    def __init__(self, matcher: Any, constraint: GrammarConstraint, max_tokens: int):
        self.matcher = matcher
        self.constraint = constraint
        self.vocab_size = constraint.lltokenizer.vocab_size
        self.max_tokens = max_tokens
        self.prompt_length: int | None = None
        self.consumed = 0
        self.closing = False
        self.whole_answer: int | None = None

    def _closing_token(self, allowed: np.ndarray) -> int:
        return self.constraint.preference.choose(allowed)

    def _closing_distance(self, limit: int) -> int | None:
        """Tokens the closing path needs to complete the answer; None: more than limit."""
        matcher = self.matcher.deep_copy()
        steps = 0
        while not matcher.is_accepting():
            if steps >= limit:
                return None
            allowed = _allowed(matcher, self.vocab_size)
            if not allowed.any() or not matcher.consume_token(self._closing_token(allowed)):
                return None
            steps += 1
        return steps

    def _check_the_budget(self) -> None:
        """An answer that cannot be completed within ``max_tokens`` is refused before its
        first token. The tokens a whole answer takes (``whole_answer``) also say when an
        answer that could end but might go on (another of several calls) must end."""
        self.whole_answer = self._closing_distance(CLOSING_HORIZON * 4)
        needed = self.whole_answer
        if needed is None or needed <= self.max_tokens:
            return
        at_least = f"at least {needed}"
        raise ConstraintError(
            f"max_tokens {self.max_tokens} is too few for {self.constraint.description}: "
            f"its shortest answer takes {at_least} tokens of this tokenizer")

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if self.prompt_length is None:
            self.prompt_length = history.shape[-1]
            self._check_the_budget()
        fed = history.shape[-1] - self.prompt_length
        if fed > self.consumed:
            new = np.array(history[..., self.prompt_length + self.consumed:]).reshape(-1)
            for token in new.tolist():
                if not self.matcher.consume_token(int(token)):
                    raise ConstraintError(
                        f"the grammar refused token {token}: {self.matcher.get_error()}")
            self.consumed = fed
        allowed = _allowed(self.matcher, self.vocab_size)
        if not allowed.any():
            raise ConstraintError(f"the grammar allows no token: {self.matcher.get_error()}")
        left = self.max_tokens - self.consumed  # including the token sampled now
        if not self.closing and left <= CLOSING_HORIZON and not self.matcher.is_accepting():
            distance = self._closing_distance(limit=left)
            self.closing = distance is None or distance >= left - _FREE_TOKEN_SLACK
        if self.matcher.is_accepting():
            # Complete, but the grammar lets it go on: too little budget is left for
            # another whole part, so it ends here. A grammar whose answer may be empty
            # (free text, as "auto" tools' lazy grammar) has no part to fit: its text
            # runs to the budget, as an unconstrained answer's does.
            part = self.whole_answer
            if self.closing or (part != 0 and left <= (part or 0) + 1):
                only = np.zeros_like(allowed)
                ends = [t for t in self.constraint.lltokenizer.eos_tokens if t < only.size]
                only[ends] = allowed[ends]
                if only.any():
                    allowed = only
        elif self.closing:
            only = np.zeros_like(allowed)
            only[self._closing_token(allowed)] = True
            allowed = only
        width = logits.shape[-1]
        mask = np.zeros(width, dtype=bool)
        mask[: min(width, allowed.size)] = allowed[:width]
        return mx.where(mx.array(mask), logits, mx.array(-np.inf, dtype=logits.dtype))


def json_schema_constraint(tokenizer: Any, eos_token_ids: Iterable[int],
                           schema: dict | None, *, strict: bool = True) -> GrammarConstraint:
    """Answers that are JSON valid under ``schema``; ``None``: any JSON object.
    ``strict``: no properties beyond those the schema names (OpenAI's strict mode)."""
    llguidance = _llguidance()
    described = "the JSON schema" if schema is not None else "a JSON object"
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise ConstraintError("a JSON schema must be an object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False},
            # Not strict: keywords llguidance does not implement are ignored, not refused.
            overrides=None if strict else {"lenient": True})
    except ValueError as error:
        raise ConstraintError(f"{described} cannot be used: {error}") from None
    return GrammarConstraint(grammar, grammar_tokenizer(tokenizer, eos_token_ids), described)


def lark_constraint(tokenizer: Any, eos_token_ids: Iterable[int], lark: str,
                    description: str) -> GrammarConstraint:
    """Answers in the language of a Lark grammar (llguidance's dialect, where
    ``%json {schema}`` embeds a JSON schema)."""
    llguidance = _llguidance()
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    return GrammarConstraint(grammar, grammar_tokenizer(tokenizer, eos_token_ids), description)
