"""The closing path of constrained decoding: from where an answer stands, at each step the
allowed token that brings it nearest its end, until the grammar accepts it. It is how
``mlxvlm.sampling.constrained`` completes an answer in time near the end of its token budget, and
how it measures what a complete answer takes (refusing a budget that is too small).

Which token closes depends on whether the answer is inside a JSON string: there a quote
ends the string (and brackets are just text), outside it a quote opens one. That state
is read from the answer's bytes (``ClosingCursor``), not guessed from which tokens the
grammar allows: a string under a ``pattern`` allows neither bracket, and its closing
quote must still be found (looking one token ahead where the best-scored token alone
would never reach it).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np

# The quote outside a string opens one, so it is avoided there; it outweighs any run of
# brackets a token can hold. An opening bracket is a structure more to close, and a
# minus sign a number that still needs its digits.
_QUOTE = -1e5
_CLOSERS = {ord('"'): _QUOTE, ord("}"): 900.0, ord("]"): 900.0, ord("{"): -900.0,
            ord("["): -900.0, ord("-"): -0.5}
_WHITESPACE = -1e6
_NO_TEXT = -2e6
# Inside a string: a token that begins with the closing quote before any other, and its
# quote counted as closing, not opening.
_INSIDE_STRING_QUOTE = 1e7 - _QUOTE
# The best-scored tokens tried against a step's mask before all the others are ranked:
# the allowed closer is almost always among the first, and where a mask allows most of
# the vocabulary (inside a string) among the next.
_CANDIDATE_BLOCKS = ((0, 64), (64, 1024))

_BACKSLASH, _QUOTE_BYTE = ord("\\"), ord('"')

# (inside a string, after a backslash)
StringState = tuple[bool, bool]
OUTSIDE: StringState = (False, False)


def _after(state: StringState, text: bytes) -> StringState:
    inside, escaped = state
    for byte in text:
        if not inside:
            inside = byte == _QUOTE_BYTE
        elif escaped:
            escaped = False
        elif byte == _BACKSLASH:
            escaped = True
        elif byte == _QUOTE_BYTE:
            inside = False
    return inside, escaped


class ClosingPreference:
    """A score per token for the closing path: tokens with more closing brackets and no
    quotes or opening brackets first, then shorter ones; whitespace, then tokens without
    text (special tokens) last but choosable (a grammar may need one, e.g. a tool-call
    marker). Inside a string a token that begins with the quote that ends it comes first
    (a byte-level BPE has tokens like ``]]]]`` and ``","``, which would otherwise keep the
    string going, or open the next one). Built once per grammar tokenizer
    (``constrained``)."""

    def __init__(self, lltokenizer: Any):
        size = lltokenizer.vocab_size
        scores = np.full(size, _NO_TEXT)
        quoted = np.zeros(size, dtype=bool)
        self.string_bytes: dict[int, bytes] = {}  # the tokens that move the string state
        for token in range(size):
            text = lltokenizer.decode_bytes([token])
            if not text or lltokenizer.is_special_token(token):
                continue
            scores[token] = sum(_CLOSERS.get(byte, 0.0) for byte in text) - len(text)
            if not text.strip():  # whitespace never closes anything (a grammar may
                scores[token] = _WHITESPACE  # allow it forever between tokens)
            quoted[token] = text.startswith(b'"')  # (a quote later may be escaped)
            if b'"' in text or b"\\" in text:
                self.string_bytes[token] = text
        inside = np.where(quoted, scores + _INSIDE_STRING_QUOTE, scores)
        self.size = size
        self._scores = (scores, inside)
        # Best first; equal scores by token id, as an argmax would pick them.
        self._orders = (np.argsort(-scores, kind="stable"), np.argsort(-inside, kind="stable"))
        self._ranks = tuple(np.argsort(order) for order in self._orders)  # token -> place

    def after(self, state: StringState, token: int) -> StringState:
        text = self.string_bytes.get(token)
        if text is not None:
            return _after(state, text)
        if state[1] and self._scores[0][token] != _NO_TEXT:
            return state[0], False  # its first byte is the escaped one
        return state

    def score(self, token: int, state: StringState) -> float:
        return float(self._scores[1 if state[0] else 0][token])

    def choose(self, mask: bytes, state: StringState) -> int | None:
        """The closing token among those ``mask`` (llguidance's bitmask) allows; None
        when it allows none."""
        best = self.best_allowed(mask, state, 1)
        return best[0] if best else None

    def best_allowed(self, mask: bytes, state: StringState, count: int) -> list[int]:
        """Up to ``count`` of the tokens ``mask`` allows, best first."""
        bits = np.frombuffer(mask, dtype=np.uint8)
        which = 1 if state[0] else 0
        order = self._orders[which]
        found = order[:0]
        for start, stop in _CANDIDATE_BLOCKS:
            block = order[start:stop]
            allowed = np.flatnonzero((bits[block >> 3] >> (block & 7)) & 1)
            found = np.concatenate([found, block[allowed[: count - len(found)]]])
            if len(found) >= count:
                return found.tolist()
        # All the allowed tokens, ranked (unpacking only the mask's nonzero bytes:
        # outside a string few are).
        nonzero = np.flatnonzero(bits)
        rows, columns = np.nonzero(np.unpackbits(bits[nonzero, None], axis=1,
                                                 bitorder="little"))
        allowed = nonzero[rows] * 8 + columns
        ranks = self._ranks[which][allowed[allowed < self.size]]
        if len(ranks) > count:
            ranks = ranks[np.argpartition(ranks, count - 1)[:count]]
        return order[np.sort(ranks)].tolist()


# Inside a string the best-scored token may never end it (under "pattern": "^a+b$"
# that is "a", for ever), so the path looks one token ahead, among this many of the
# best, at its first token in a string and again each time its run there doubles (a
# string that only needs to be long, under minLength, costs a few looks, not one per
# token).
_LOOKAHEAD = 8


class ClosingCursor:
    """Where the closing path stands on one matcher: inside a JSON string or not, and how
    many of its own tokens it has taken in the string it is in."""

    def __init__(self, preference: ClosingPreference):
        self.preference = preference
        self.state = OUTSIDE
        self.run = 0  # the path's own tokens in the string it is in
        self.look_due = False  # at the next step with a choice to make
        self.last: int | None = None

    def restart(self) -> "ClosingCursor":
        """The path starts here (its run in a string counts from now)."""
        self.run, self.look_due = 0, self.state[0]
        return self

    def advance(self, token: int) -> None:
        self.state = self.preference.after(self.state, token)
        self.run = self.run + 1 if self.state[0] else 0
        step = self.run + 1
        self.look_due = self.state[0] and (self.look_due or step & (step - 1) == 0)
        self.last = token

    def choose(self, matcher: Any, mask: bytes) -> int | None:
        """The closing path's next token from ``matcher``, whose allowed tokens are
        ``mask`` (a look ahead it was due for is then done)."""
        preference = self.preference
        candidates = preference.best_allowed(mask, self.state, _LOOKAHEAD)
        if not self.look_due or len(candidates) < 2:
            return candidates[0] if candidates else None
        self.look_due = False
        # Looking ahead: a token that ends the string, else the one after which the best
        # token that may follow scores highest (the closing quote, where some token lets
        # it come next); between equals, another token than the last one.
        chosen, value = None, (-np.inf, False)
        for token in candidates:
            state = preference.after(self.state, token)
            if not state[0]:
                return token
            trial = matcher.deep_copy()
            if not trial.consume_token(token):
                continue
            following = preference.choose(trial.compute_bitmask(), state)
            score = -np.inf if following is None else preference.score(following, state)
            if chosen is None or (score, token != self.last) > value:
                chosen, value = token, (score, token != self.last)
        return chosen


class ClosingWalk:
    """The closing path followed on a copy of a matcher, one step at a time, so that a
    long walk can be continued later instead of begun again. ``failed`` turns a grammar
    failure on the way into the caller's error."""

    def __init__(self, matcher: Any, cursor: ClosingCursor,
                 failed: Callable[[str], Exception]):
        self.matcher = matcher.deep_copy()
        self.cursor = copy.copy(cursor).restart()
        self.failed = failed
        self.steps = 0
        self.dead_end = False  # no allowed token, or the grammar stopped short

    def run(self, limit: int) -> int | None:
        """Steps to a complete answer, walking on up to ``limit`` in all; None: more."""
        matcher = self.matcher
        while not matcher.is_accepting():
            if self.dead_end or self.steps >= limit:
                return None
            mask = matcher.compute_bitmask()
            if matcher.is_error():
                raise self.failed(matcher.get_error())
            token = self.cursor.choose(matcher, mask)
            if token is None:
                self.dead_end = True
                return None
            if not matcher.consume_token(token):
                raise self.failed(matcher.get_error())
            self.cursor.advance(token)
            self.steps += 1
        return self.steps
