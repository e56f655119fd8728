"""The prompt's length bounded before it is tokenized whole (mlxvlm.prompt_length),
checked against the tokenizer's own count of the whole text: a text is refused only when
it cannot fit, and the length a refusal states is never more than the text's."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mlxvlm import prompt_length
from mlxvlm.errors import PromptTooLongError
from mlxvlm.prompt_length import check_prompt_length, longest_token_chars

DEMO = Path(__file__).parents[1] / "examples" / "shapes-vlm"
CONTEXT = 300


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO)


def true_length(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_no_token_stands_for_more_characters_than_the_bound(tokenizer):
    longest = longest_token_chars(tokenizer)
    assert all(len(tokenizer.decode([i])) <= longest for i in range(len(tokenizer)))
    assert longest_token_chars(tokenizer) == longest  # cached per tokenizer


def test_the_character_bound_refuses_at_once(tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(a) or [])
    bound = CONTEXT * longest_token_chars(tokenizer) * prompt_length.NORMALIZATION_SLACK
    with pytest.raises(PromptTooLongError, match=f"{bound + 1:,} characters long"):
        check_prompt_length(tokenizer, "x" * (bound + 1), CONTEXT)
    assert not calls  # nothing tokenized


@pytest.mark.parametrize("words", [50, 220, 223, 224, 226, 230, 400, 2000])
def test_counting_in_pieces_refuses_only_what_cannot_fit(tokenizer, monkeypatch, words):
    """Pieces of 400 characters (cut at spaces) and counting from the first character up,
    so that every text is counted in several pieces: about 300 tokens straddle the
    context."""
    monkeypatch.setattr(prompt_length, "PIECE_CHARS", 400)
    monkeypatch.setattr(prompt_length, "COUNT_ABOVE_CHARS_PER_TOKEN", 0)
    text = " ".join(["circle", "red", "triangle", "square"] * words)[: words * 9]
    length = true_length(tokenizer, text)
    cuts = len(text) // 400
    try:
        check_prompt_length(tokenizer, text, CONTEXT)
    except PromptTooLongError as refusal:
        stated = int(str(refusal).split("at least ")[1].split()[0])
        assert CONTEXT <= stated <= length
    else:
        # Left to the exact check after tokenizing: what fits, or is within the slack.
        assert length < CONTEXT + prompt_length.CUT_SLACK_TOKENS * cuts
        assert length < 2 * CONTEXT  # far too long is refused by the count


def test_no_context_no_bound(tokenizer):
    check_prompt_length(tokenizer, "x" * 10**6, None)
