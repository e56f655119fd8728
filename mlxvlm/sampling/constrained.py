"""Constrained decoding: a grammar (a JSON schema, any JSON object) that every sampled
token must keep the answer within, applied as one more logits processor of the sampling
step, so that it works alike in ``generate``, the batching engine, the server and the UI.

The grammar engine is llguidance (the ``structured`` extra): it compiles JSON schemas
itself and computes each step's allowed tokens from the tokenizer's own vocabulary in
microseconds. Its tokens are the checkpoint's tokenizer's; ids past them (a head padded
beyond the vocabulary) are never allowed. Once the grammar is complete only the end of
the answer (the checkpoint's end-of-sequence ids) is allowed.

A grammar is compiled, and the closing path (``mlxvlm.sampling.closing_path``) walked through a
whole answer, before a request runs: what llguidance cannot parse (e.g. more
alternatives at once than its parser allows) and a token budget too small for a complete
answer are refused then, not found by the batch the request would have joined.
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from typing import Any, Iterable, Sequence

import mlx.core as mx
import numpy as np

from mlxvlm.sampling.closing_path import ClosingCursor, ClosingPreference, ClosingWalk
from mlxvlm.errors import MlxvlmError, bounded


class ConstraintError(MlxvlmError, ValueError):
    """A grammar or schema that cannot be used (invalid, too large for the parser, or
    llguidance is missing), or a token budget it cannot be completed in. ``reason``:
    "grammar" or "max_tokens" (which of the request's fields is at fault)."""

    def __init__(self, message: str, reason: str = "grammar"):
        super().__init__(message)
        self.reason = reason


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ConstraintError(
            "structured output needs llguidance: pip install 'mlxvlm[structured]'") from None
    return llguidance


class GrammarTokenizer:
    """llguidance's view of one transformers tokenizer (``lltokenizer``) and its closing
    preference, built at first use (both cost about a second for a large vocabulary)."""

    def __init__(self, lltokenizer: Any):
        self.lltokenizer = lltokenizer
        self._preference: ClosingPreference | None = None
        self._lock = threading.Lock()

    @property
    def preference(self) -> ClosingPreference:
        with self._lock:
            if self._preference is None:
                self._preference = ClosingPreference(self.lltokenizer)
            return self._preference


# Grammar tokenizers by transformers tokenizer, then by end ids; weakly keyed, so that
# they go with the tokenizer (an unloaded model's), not on it (it must stay picklable).
_GRAMMAR_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], GrammarTokenizer]]" = \
    weakref.WeakKeyDictionary()
_BUILDING = threading.Lock()


def grammar_tokenizer(tokenizer: Any, eos_token_ids: Iterable[int]) -> GrammarTokenizer:
    """llguidance's view of ``tokenizer`` (a transformers fast tokenizer), ending answers
    with ``eos_token_ids``; built once per tokenizer while it lives."""
    eos = tuple(sorted(set(eos_token_ids)))
    llguidance = _llguidance()
    with _BUILDING:
        try:
            kept = _GRAMMAR_TOKENIZERS.setdefault(tokenizer, {})
        except TypeError:  # not weakly referable: built for this use only
            kept = {}
        if eos not in kept:
            try:
                built = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos) or None)
            except ValueError as error:
                raise ConstraintError(
                    f"structured output needs a fast tokenizer: {bounded(str(error))}") from None
            kept[eos] = GrammarTokenizer(built)
        return kept[eos]


# How much longer one freely chosen token can make the closing path: a UTF-8 lead byte
# needs up to 3 more bytes, a "\u" escape 4 hex digits, before the answer can close.
_FREE_TOKEN_SLACK = 6
# How many tokens before the end of the budget (beyond what a whole answer takes) a
# sequence starts to check that it can still close its answer in time (a check per
# token costs one simulated closing).
CLOSING_HORIZON = 256


def tag_progress(tail: Sequence[int], tag: Sequence[int]) -> int:
    """How many of ``tag``'s tokens ``tail`` ends with, short of the whole tag: a tag
    begun (by the model, or forced part way) goes on where it is."""
    for begun in range(len(tag) - 1, 0, -1):
        if len(tail) >= begun and tuple(tail[-begun:]) == tuple(tag[:begun]):
            return begun
    return 0


def ends_with(tail: Sequence[int], tag: Sequence[int]) -> bool:
    return len(tail) >= len(tag) and tuple(tail[-len(tag):]) == tuple(tag)


class GrammarConstraint:
    """A compiled grammar over one tokenizer; ``processor(max_tokens)`` gives each sequence
    its own matcher, as a logits processor ``(history, logits) -> logits``."""

    def __init__(self, grammar: str, tokenizer: GrammarTokenizer, description: str):
        llguidance = _llguidance()
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.lltokenizer = tokenizer.lltokenizer
        self.description = description
        # The end-of-thinking tag the answer's thoughts run to before the grammar applies
        # (empty: the grammar applies from the first token).
        self.thoughts_close: tuple[int, ...] = ()
        start = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if start.is_error():
            raise self.unusable(start.get_error())
        self._start = start  # each sequence's matcher is a copy (a copy costs nothing)
        self._walk: ClosingWalk | None = None
        self._lock = threading.Lock()

    @property
    def preference(self) -> ClosingPreference:
        return self.tokenizer.preference

    def unusable(self, problem: str) -> ConstraintError:
        return ConstraintError(f"{self.description} cannot be used: {bounded(problem)}")

    def answer_length(self, limit: int) -> int | None:
        """Tokens the closing path takes from the start to a whole answer (the shortest
        answer, as near as that path finds it); None: more than ``limit``. The walk is
        kept, so a larger limit later goes on from where this one stopped. Raises
        ``ConstraintError`` where the grammar fails on the way."""
        with self._lock:
            if self._walk is None:
                self._walk = ClosingWalk(self._start, ClosingCursor(self.preference),
                                         self.unusable)
            steps = self._walk.run(limit)
            if steps is None and self._walk.dead_end:
                raise ConstraintError(f"{self.description} has no complete answer")
        return steps if steps is not None and steps <= limit else None

    def check_budget(self, max_tokens: int, context: int | None = None) -> int:
        """The tokens a whole answer takes; refuses (``ConstraintError``, reason
        "max_tokens") a budget it does not fit in, before any token is generated.
        ``context``: the model's, which bounds the budget (and so the walk that measures
        the answer) where ``max_tokens`` asks for more."""
        budget = max_tokens if context is None else min(max_tokens, context)
        room = budget - len(self.thoughts_close)
        needed = self.answer_length(room) if room > 0 else None
        if needed is None:
            after = " (after closing the thoughts)" if self.thoughts_close else ""
            what = (f"max_tokens {max_tokens} is" if budget == max_tokens else
                    f"the model's context of {context} tokens leaves")
            raise ConstraintError(
                f"{what} too few for {self.description}: a complete answer{after} takes "
                f"more than {budget} tokens of this tokenizer", reason="max_tokens")
        return needed

    def after_thoughts(self, close_ids: Sequence[int]) -> "GrammarConstraint":
        """This grammar for an answer that begins inside a thinking block its prompt
        opened: free thoughts (but not the end of the answer) until the ``close_ids``
        tag, then the grammar. The tag is forced in time for a whole answer to follow, and
        a thinking budget's forced tag is one the grammar expects."""
        twin = copy.copy(self)
        twin.thoughts_close = tuple(close_ids)
        return twin

    def processor(self, max_tokens: int) -> "GrammarProcessor":
        return GrammarProcessor(self, max_tokens)


class GrammarProcessor:
    """One sequence's matcher: it consumes each token fed back and masks the logits to the
    tokens the grammar allows next.

    An answer cut by the token budget would not be valid, so near the end of the budget
    the processor checks how many tokens the closing path needs to complete the answer
    from here, simulated on a copy of the matcher; once the budget left is no more than
    that, it follows the closing path itself."""

    def __init__(self, constraint: GrammarConstraint, max_tokens: int):
        self.matcher = constraint._start.deep_copy()
        self.constraint = constraint
        self.vocab_size = constraint.lltokenizer.vocab_size
        self.max_tokens = max_tokens
        self.prompt_length: int | None = None
        self.consumed = 0  # answer tokens fed back (thoughts included)
        self.cursor: ClosingCursor | None = None  # where the closing path stands, once needed
        self.closing = False
        self.whole_answer = 0
        close = constraint.thoughts_close
        self.thinking = bool(close)
        self.thought_tail: list[int] = []

    def _check_the_budget(self) -> None:
        """An answer that cannot be completed within ``max_tokens`` is refused before its
        first token. The tokens a whole answer takes (``whole_answer``) also say when an
        answer that could end but might go on (another of several calls) must end, and
        from when to check that the answer can still close."""
        self.whole_answer = self.constraint.check_budget(self.max_tokens)

    def _feed(self, token: int) -> None:
        if self.thinking:
            close = self.constraint.thoughts_close
            self.thought_tail = (self.thought_tail + [token])[-len(close):]
            self.thinking = not ends_with(self.thought_tail, close)
            return
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"the grammar refused token {token}: "
                                  f"{bounded(self.matcher.get_error())}")
        self.cursor.advance(token)

    def _closing_distance(self, limit: int) -> int | None:
        """Tokens the closing path needs to complete the answer; None: more than limit."""
        return ClosingWalk(self.matcher, self.cursor, self.constraint.unusable).run(limit)

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if self.prompt_length is None:
            self.prompt_length = history.shape[-1]
            self._check_the_budget()
            self.cursor = ClosingCursor(self.constraint.preference)
        fed = history.shape[-1] - self.prompt_length
        if fed > self.consumed:
            new = np.array(history[..., self.prompt_length + self.consumed:]).reshape(-1)
            for token in new.tolist():
                self._feed(int(token))
            self.consumed = fed
        left = self.max_tokens - self.consumed  # including the token sampled now
        if self.thinking:
            allowed = self._thinking_allowed(left)
        else:
            allowed = self._grammar_allowed(left)
        width = logits.shape[-1]
        mask = np.zeros(width, dtype=bool)
        mask[: min(width, allowed.size)] = allowed[:width]
        return mx.where(mx.array(mask), logits, mx.array(-np.inf, dtype=logits.dtype))

    def _thinking_allowed(self, left: int) -> np.ndarray:
        """Inside the thoughts: any token but the end of the answer, until the tag that
        closes them must come for a whole answer to follow in the budget left."""
        close = self.constraint.thoughts_close
        begun = tag_progress(self.thought_tail, close)
        allowed = np.ones(self.vocab_size, dtype=bool)
        if left - (len(close) - begun) <= self.whole_answer + _FREE_TOKEN_SLACK:
            allowed[:] = False
            allowed[close[begun]] = True
        else:
            ends = [t for t in self.constraint.lltokenizer.eos_tokens if t < allowed.size]
            allowed[ends] = False
        return allowed

    def _grammar_allowed(self, left: int) -> np.ndarray:
        matcher = self.matcher
        mask = matcher.compute_bitmask()
        if matcher.is_error():
            raise self.constraint.unusable(matcher.get_error())
        allowed = _unpack(mask, self.vocab_size)
        if not allowed.any():
            raise ConstraintError(f"the grammar allows no token: {bounded(matcher.get_error())}")
        horizon = CLOSING_HORIZON + self.whole_answer
        if not self.closing and left <= horizon and not matcher.is_accepting():
            distance = self._closing_distance(limit=left)
            self.closing = distance is None or distance >= left - _FREE_TOKEN_SLACK
            if self.closing:  # the path the distance was measured on, from here
                self.cursor.restart()
        if matcher.is_accepting():
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
            token = self.cursor.choose(matcher, mask)
            if token is not None:
                allowed = np.zeros_like(allowed)
                allowed[token] = True
        return allowed


def _unpack(mask: bytes, vocab_size: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(mask, dtype=np.uint8),
                         bitorder="little")[:vocab_size].astype(bool)


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
        raise ConstraintError(f"{described} cannot be used: {bounded(str(error))}") from None
    return GrammarConstraint(grammar, grammar_tokenizer(tokenizer, eos_token_ids), described)


def lark_constraint(tokenizer: Any, eos_token_ids: Iterable[int], lark: str,
                    description: str) -> GrammarConstraint:
    """Answers in the language of a Lark grammar (llguidance's dialect, where
    ``%json {schema}`` embeds a JSON schema)."""
    llguidance = _llguidance()
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as error:
        raise ConstraintError(f"{description} cannot be used: {bounded(str(error))}") from None
    return GrammarConstraint(grammar, grammar_tokenizer(tokenizer, eos_token_ids), description)
