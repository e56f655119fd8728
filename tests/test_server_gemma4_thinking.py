"""Gemma 4's thoughts (``<|channel>thought\\n`` ... ``<channel|>``, special tokens the
detokenizer drops by default) come back apart from the answer: chat completions'
``reasoning_content`` (whole and streamed), Messages' thinking block and the Responses
reasoning item; a template without thinking keeps ``decode(skip_special_tokens=True)``.

The tiny Gemma 4 is random: a scripted logits processor (tests/scripted_tokens.py) makes
it answer with chosen tokens through the real engine and detokenizer."""

from __future__ import annotations

import anthropic
import pytest
from scripted_tokens import script_tokens
from server_harness import MODEL_ID, LiveServer
from test_server_thinking_budget import run

import mlxvlm
from mlxvlm.text.answer_parts import GEMMA4_THINK, THINK, AnswerSplitter, marker_ids, think_format
from mlxvlm.server.thinking_budget import ThinkingBudget

ANSWER = "<|channel>thought\nI think so.<channel|>It is blue."
THOUGHTS, CONTENT = "I think so.", "It is blue."
ASK = [{"role": "user", "content": "What colour?"}]
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("gemma4", "hub"))


def scripted_ids(processor) -> list[int]:
    tokenizer = processor.tokenizer
    return tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]


@pytest.fixture
def scripted(loaded, monkeypatch):
    """Every sequence's tokens are the script's."""
    script = scripted_ids(loaded[1])
    script_tokens(monkeypatch, script)
    return script


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(*loaded) as live:
        yield live


def test_the_template_names_the_format(loaded):
    template = loaded[1].chat_template
    assert think_format(template) is GEMMA4_THINK
    assert think_format("<|turn>model\n<|channel>thought\n<channel|>") is GEMMA4_THINK
    assert think_format("{{ '<think>' }}") is THINK and think_format("plain") is None
    tokenizer = loaded[1].tokenizer
    assert marker_ids(tokenizer, GEMMA4_THINK) == {
        tokenizer.convert_tokens_to_ids("<|channel>"), tokenizer.convert_tokens_to_ids("<channel|>")}
    assert marker_ids(tokenizer, THINK) == frozenset()  # plain text: nothing to keep


def test_the_thoughts_come_back_apart(server, scripted):
    client = server.client()
    message = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, max_tokens=64, extra_body=THINKING).choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHTS
    assert message.content == CONTENT

    reasoning, content = [], []
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=64,
                                                stream=True, extra_body=THINKING):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
            content.append(delta.content or "")
    assert "".join(reasoning) == THOUGHTS and "".join(content) == CONTENT
    assert sum(bool(r) for r in reasoning) > 1, "the thoughts did not stream"

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    answer = claude.messages.create(model=MODEL_ID, max_tokens=64, messages=ASK,
                                    thinking={"type": "enabled", "budget_tokens": 1000})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in answer.content] == [("thinking", THOUGHTS), ("text", CONTENT)]
    response = client.responses.create(model=MODEL_ID, input=ASK[0]["content"],
                                       max_output_tokens=64, reasoning={"effort": "medium"})
    assert response.output_text == CONTENT
    [item] = [item for item in response.output if item.type == "reasoning"]
    assert "".join(part.text for part in item.content or item.summary) == THOUGHTS


def test_a_template_without_thinking_is_unchanged(loaded, scripted):
    model, processor = loaded
    template = processor.chat_template.replace("<|think|>", "")
    original = processor.chat_template, processor.tokenizer.chat_template
    processor.chat_template = processor.tokenizer.chat_template = template
    try:
        with LiveServer(model, processor) as live:
            message = live.client().chat.completions.create(
                model=MODEL_ID, messages=ASK, max_tokens=64).choices[0].message
    finally:
        processor.chat_template, processor.tokenizer.chat_template = original
    expected = processor.tokenizer.decode(scripted[:-1], skip_special_tokens=True)
    assert message.content == expected == "thought\n" + THOUGHTS + CONTENT
    assert not (message.model_extra or {}).get("reasoning_content")


def test_the_budget_closes_gemma4s_thoughts_through_the_server(server, loaded, monkeypatch):
    tokenizer = loaded[1].tokenizer
    opened = tokenizer.encode("<|channel>thought\nI think so.", add_special_tokens=False)
    answer = tokenizer.encode("It is blue.", add_special_tokens=False)
    # The script leaves one step free where the budget is spent: the budget forces
    # <channel|> there; without a budget the model writes on and never closes.
    script_tokens(monkeypatch, opened + [None] + answer + [tokenizer.eos_token_id])
    client = server.client()
    budget = {**THINKING, "thinking_budget": len(opened) - 1}
    budgeted = client.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=64,
                                              extra_body=budget).choices[0].message
    assert budgeted.model_extra["reasoning_content"] == THOUGHTS
    assert budgeted.content == CONTENT
    free = client.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=64,
                                          extra_body=THINKING).choices[0].message
    assert free.model_extra["reasoning_content"].startswith(THOUGHTS) and not free.content


def test_the_budget_forces_gemma4s_close(loaded):
    tokenizer = loaded[1].tokenizer
    budget = ThinkingBudget(tokenizer, 3, GEMMA4_THINK)
    opened, closed = sorted(marker_ids(tokenizer, GEMMA4_THINK))
    width = len(tokenizer)
    # Opened by the model: three thinking tokens, then <channel|> (one token), then free.
    assert run(budget.processor(20), [1, 2], [5, opened, 5, 5, 5, 6, 6, 6], width) == \
        [None, None, None, None, None, closed, None, None]
    # Closed by the model in time: never forced.
    assert run(budget.processor(20), [1, 2], [opened, 5, closed, 6, 6, 6], width) == [None] * 6


def split(pieces: list[str], reasoning_first: bool = False) -> list[tuple[str, str]]:
    splitter = AnswerSplitter(None, GEMMA4_THINK, reasoning_first)
    parts = [p for piece in pieces for p in splitter.feed(piece)] + splitter.finish()
    merged: list[tuple[str, str]] = []
    for part in parts:
        if merged and merged[-1][0] == part.kind:
            merged[-1] = (part.kind, merged[-1][1] + part.text)
        else:
            merged.append((part.kind, part.text))
    return merged


def test_the_channel_label_is_not_thought():
    # The label split over pieces, as tokens bring it.
    assert split(["<|channel>", "thou", "ght", "\nHm.", "<chan", "nel|>", "Blue."]) == \
        [("reasoning", "Hm."), ("content", "Blue.")]
    # Thoughts without the label keep all their text; a prompt that opened the block.
    assert split(["<|channel>though", "tful.<channel|>Blue."]) == \
        [("reasoning", "thoughtful."), ("content", "Blue.")]
    assert split(["thought\nHm.<channel|>", "Blue."], reasoning_first=True) == \
        [("reasoning", "Hm."), ("content", "Blue.")]
    # An empty thought channel (thinking off) leaves just the answer.
    assert split(["<|channel>thought\n<channel|>Blue."]) == [("content", "Blue.")]
    assert GEMMA4_THINK.opened_by("<|turn>model\n<|channel>thought\n")
    assert not GEMMA4_THINK.opened_by("<|turn>model\n<|channel>thought\n<channel|>")
