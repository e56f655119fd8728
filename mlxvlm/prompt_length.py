"""Refusing a prompt too long for the model's context before tokenizing all of it.

Tokenizing costs time and memory in proportion to the text (a 6 MB message took seconds
and over a gigabyte), and a request body may hold tens of megabytes, so a rendered chat
is bounded in two cheap steps before the processor tokenizes it (and before any medium
is decoded):

1. by characters: no token stands for more characters than the vocabulary's longest
   token string, so a longer text than ``context * longest * NORMALIZATION_SLACK``
   characters cannot fit;
2. a text longer than ``COUNT_ABOVE_CHARS_PER_TOKEN`` characters per token of context is
   tokenized in pieces, and the count stops as soon as it shows the prompt cannot fit.

Both give lower bounds on the prompt's length: the processor only adds tokens to the
text's (media placeholders expand, special tokens are added), so a prompt refused here
is one the context check after tokenizing would refuse too, with the same error.
"""

from __future__ import annotations

import weakref
from typing import Any

from mlxvlm.errors import PromptTooLongError

# A normalizer may compose several characters into one before tokens are matched (NFC:
# up to three code points into one Hangul syllable), so a token's text can stand for a
# few more characters of the input than its own length.
NORMALIZATION_SLACK = 4
# Texts up to this many characters per token of context are tokenized whole at once:
# ordinary text runs 3 to 5 characters a token, and the processor tokenizes them anyway.
COUNT_ABOVE_CHARS_PER_TOKEN = 4
PIECE_CHARS = 16_384
# Tokens a cut between two pieces may add to their count (a word or a run of spaces split
# in two, a piece's leading-space marker); a cut is made at whitespace where there is any.
CUT_SLACK_TOKENS = 8
_CUT_SEARCH = 256

_longest: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters any token's text covers: the longest string of the vocabulary
    (byte-level BPE spells each byte as one character, SentencePiece its pieces as they
    read, and a character takes at least one byte); computed once per tokenizer."""
    try:
        return _longest[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    try:
        _longest[tokenizer] = longest
    except TypeError:  # a tokenizer that cannot be weakly referenced: not cached
        pass
    return longest


def _pieces(text: str):
    start = 0
    while start < len(text):
        end = min(start + PIECE_CHARS, len(text))
        if end < len(text):
            # Cut before whitespace near the end, so that words stay whole.
            space = max(text.rfind(" ", end - _CUT_SEARCH, end),
                        text.rfind("\n", end - _CUT_SEARCH, end))
            if space > start:
                end = space
        yield text[start:end]
        start = end


def check_prompt_length(tokenizer: Any, text: str, context: int | None) -> None:
    """Raise ``PromptTooLongError`` when ``text`` (a rendered chat) cannot fit in
    ``context`` tokens, as found out cheaply; None: the model does not say its context."""
    if context is None:
        return
    longest = longest_token_chars(tokenizer)
    most_chars = context * longest * NORMALIZATION_SLACK
    if len(text) > most_chars:
        raise PromptTooLongError(
            f"the prompt is {len(text):,} characters long, more than the model's context "
            f"of {context} tokens can hold (its tokens are at most {longest} characters); "
            "shorten the prompt")
    if len(text) <= context * COUNT_ABOVE_CHARS_PER_TOKEN:
        return
    counted = 0
    for index, piece in enumerate(_pieces(text)):
        counted += len(tokenizer.encode(piece, add_special_tokens=False))
        at_least = counted - CUT_SLACK_TOKENS * index
        if at_least >= context:
            raise PromptTooLongError.of_tokens(at_least, context, at_least=True)
