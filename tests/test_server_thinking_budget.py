"""The thinking budget (``server/thinking_budget.py``): after ``budget`` thinking tokens
the end-of-thinking tag is forced, through chat completions (``thinking_budget``),
Anthropic's Messages (``thinking.budget_tokens``) and Responses (``reasoning.max_tokens``),
on the tiny thinking checkpoint of test_server_tools (its generation prompt opens
``<think>``; the random model never closes it by itself)."""

from __future__ import annotations

import anthropic
import mlx.core as mx
import pytest
from server_harness import MODEL_ID, LiveServer
from test_server_tools import ASK, checkpoint  # noqa: F401  (the fixture)

import mlxvlm
from mlxvlm.server.thinking_budget import ThinkingBudget, tag_ids

BUDGET = 5
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def loaded(checkpoint):  # noqa: F811
    return mlxvlm.load(checkpoint)


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(*loaded) as live:
        yield live


def tokens_of(choice) -> list[str]:
    return [entry.token for entry in choice.logprobs.content]


def test_the_budget_closes_the_thoughts_and_the_answer_follows(server, loaded):
    client = server.client()
    free = client.chat.completions.create(model=MODEL_ID, messages=ASK, logprobs=True,
                                          **GREEDY).choices[0]
    budgeted = client.chat.completions.create(
        model=MODEL_ID, messages=ASK, logprobs=True, extra_body={"thinking_budget": BUDGET},
        **GREEDY).choices[0]
    close = tag_ids(loaded[1].tokenizer, "</think>")
    free_tokens, tokens = tokens_of(free), tokens_of(budgeted)
    # Without the budget all 24 tokens are thoughts; with it, the first 5 are the same
    # thoughts, then the closing tag, then the answer.
    assert free.message.model_extra["reasoning_content"] and not free.message.content
    assert tokens[:BUDGET] == free_tokens[:BUDGET]
    assert "".join(tokens[BUDGET:BUDGET + len(close)]) == "</think>"
    assert tokens[BUDGET:BUDGET + len(close)] != free_tokens[BUDGET:BUDGET + len(close)]
    assert len(tokens) == GREEDY["max_tokens"]
    short = client.chat.completions.create(model=MODEL_ID, messages=ASK, temperature=0,
                                           max_tokens=BUDGET).choices[0].message
    reasoning = budgeted.message.model_extra["reasoning_content"]
    assert reasoning == short.model_extra["reasoning_content"]
    assert budgeted.message.content
    assert budgeted.finish_reason == "length"

    # The same budget through the other endpoints gives the same answer.
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(
        model=MODEL_ID, max_tokens=GREEDY["max_tokens"], messages=ASK,
        thinking={"type": "enabled", "budget_tokens": BUDGET}, extra_body={"temperature": 0})
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == reasoning
    assert message.content[1].text == budgeted.message.content
    response = client.responses.create(model=MODEL_ID, input=ASK[0]["content"],
                                       max_output_tokens=GREEDY["max_tokens"], temperature=0,
                                       reasoning={"max_tokens": BUDGET})
    assert response.output_text == budgeted.message.content


class FakeTokenizer:
    """``<think>`` is token 7, ``</think>`` tokens 8 and 9 (two, as many BPE vocabularies
    spell it)."""

    def encode(self, text, add_special_tokens=False):
        return {"<think>": [7], "</think>": [8, 9]}[text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join({7: "<think>", 8: "</th", 9: "ink>"}.get(i, "x") for i in ids)


def run(processor, prompt: list[int], answer: list[int], vocab: int = 12) -> list[int | None]:
    """The token each step is forced to (None: free), feeding ``answer`` back except
    where a token is forced."""
    history, forced = list(prompt), []
    logits = mx.zeros((1, vocab))
    for token in answer:
        out = processor(mx.array([history]), logits)
        kept = [i for i, v in enumerate(out[0].tolist()) if v > float("-inf")]
        forced.append(kept[0] if len(kept) == 1 else None)
        history.append(forced[-1] if forced[-1] is not None else token)
    return forced


def test_the_budget_counts_from_where_thinking_opens_and_stops_at_the_close():
    budget = ThinkingBudget(FakeTokenizer(), 2)
    # Opened by the model: two thoughts, then both tokens of the tag, then free.
    assert run(budget.processor(20), [1, 2], [3, 7, 3, 3, 4, 4, 4, 4]) == \
        [None, None, None, None, 8, 9, None, None]
    # Opened by the prompt and closed by the model in time: never forced (the tag
    # finished at the budget is the one the model began).
    assert run(budget.processor(20), [1, 7], [3, 8, 9, 4, 4]) == [None, None, 9, None, None]
    assert run(budget.processor(20), [1, 7], [8, 9, 4, 4, 4]) == [None] * 5
    # A tag the model began is finished, not begun again.
    assert run(budget.processor(20), [1, 7], [3, 8, 4, 4]) == [None, None, 9, None]
    # An earlier turn's closed thoughts in the prompt are not this answer's.
    assert run(budget.processor(20), [7, 3, 8, 9, 1], [3, 3, 3]) == [None] * 3
