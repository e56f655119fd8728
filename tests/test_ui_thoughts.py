"""A thinking model's answer in the chat: the thoughts stream into Gradio's folded thought
box and the answer stands apart, split as the server splits it; the next turn's prompt
leaves the thoughts out. The tiny Qwen3.5's template opens ``<think>`` in the prompt."""

from __future__ import annotations

import threading

import pytest
from scripted_tokens import script_tokens

import mlxvlm
from mlxvlm.batching import BatchStep
from mlxvlm.text.answer_parts import GEMMA4_THINK, AnswerSplitter
from mlxvlm.ui import session as session_module
from mlxvlm.ui.session import ChatSession
from mlxvlm.ui.thoughts import THOUGHTS_TITLE


@pytest.fixture(scope="module")
def thinker(tiny_checkpoints):
    model, processor = mlxvlm.load(tiny_checkpoints.path("qwen3_5", "hub"))
    session = ChatSession(model, processor, "tiny-qwen3_5").start()
    try:
        yield session
    finally:
        session.close()


def replies(session: ChatSession, text: str, history=(), max_tokens: int = 16) -> list:
    message = {"text": text, "files": []}
    return [reply for reply, _ in session.respond(message, list(history), max_tokens=max_tokens)]


def test_the_thoughts_stream_into_a_folded_box_and_stay_out_of_the_next_prompt(thinker):
    question = [{"role": "user", "content": "Hello there"}]
    expected = mlxvlm.generate(thinker.model, thinker.processor, question, max_tokens=16)
    # The template opened the thinking block; the tiny model never closes it: all thought.
    parts = AnswerSplitter(None, True, reasoning_first=True)
    split = parts.feed(expected.text) + parts.finish()
    assert [p.kind for p in split] == ["reasoning"]

    streamed = replies(thinker, "Hello there")
    final = streamed[-1]
    assert final == [{"role": "assistant", "content": split[0].text.strip("\n"),
                      "metadata": {"title": THOUGHTS_TITLE, "status": "done",
                                   "duration": final[0]["metadata"]["duration"]}}]
    pending = [r[0] for r in streamed[:-1] if r]
    assert len({box["content"] for box in pending}) > 1, "the thoughts did not stream"
    assert all(box["metadata"] == {"title": THOUGHTS_TITLE, "status": "pending"}
               for box in pending)

    # The next turn: the earlier turn is the model's, without its thoughts.
    history = [{"role": "user", "content": "Hello there"}, *final]
    follow_up = replies(thinker, "And then?", history)[-1]
    conversation = question + [{"role": "assistant", "content": ""},
                               {"role": "user", "content": "And then?"}]
    again = mlxvlm.generate(thinker.model, thinker.processor, conversation, max_tokens=16)
    assert follow_up[0]["content"] == again.text.strip("\n")


def scripted(session: ChatSession, monkeypatch, pieces: list[str]) -> None:
    """The engine answers with ``pieces`` (as if the model had generated them)."""

    def submit(inputs, options, deliver, **_):
        def run():
            for i, text in enumerate(pieces):
                last = i == len(pieces) - 1
                deliver(BatchStep(text, 0, "stop" if last else None, inputs.num_tokens, 0, i + 1))

        threading.Thread(target=run).start()
        return type("Handle", (), {"cancel": lambda self: None})()

    monkeypatch.setattr(session.engine, "submit", submit)


def test_the_answer_after_the_thoughts_stands_apart(thinker, monkeypatch):
    # Markers split over steps, as a tokenizer may emit them.
    pieces = ["Let me", " see.", "</th", "ink>", "\n\n", "It is", " blue."]
    scripted(thinker, monkeypatch, pieces)
    streamed = replies(thinker, "What colour?")
    thoughts, answer = streamed[-1]
    assert thoughts["content"] == "Let me see."
    assert thoughts["metadata"]["status"] == "done"
    assert answer == {"role": "assistant", "content": "It is blue."}
    # Nothing of a marker ever showed.
    shown = [m["content"] for r in streamed if isinstance(r, list) for m in r]
    assert not any("<" in text or "think" in text for text in shown)
    # The box was open (pending) while the model thought, done once the answer began.
    statuses = [r[0]["metadata"]["status"] for r in streamed if r]
    assert statuses[0] == "pending" and statuses[-1] == "done"
    assert all(r[0]["metadata"]["status"] == "done" for r in streamed if len(r) == 2)

    # The follow-up's prompt holds the answer, not the thoughts.
    seen = {}
    real_prepare = session_module.prepare_inputs

    def spy(processor, messages, **kwargs):
        seen["messages"] = messages
        return real_prepare(processor, messages, **kwargs)

    monkeypatch.setattr(session_module, "prepare_inputs", spy)
    replies(thinker, "Sure?", [{"role": "user", "content": "What colour?"}, thoughts, answer])
    assert seen["messages"][1] == {"role": "assistant", "content": "It is blue."}


def test_a_model_without_thinking_answers_in_plain_text(tiny_checkpoints):
    model, processor = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))
    session = ChatSession(model, processor, "tiny-qwen2-vl").start()
    try:
        assert not session.thinks
        final = replies(session, "Hello")[-1]
        expected = mlxvlm.generate(model, processor, [{"role": "user", "content": "Hello"}],
                                   max_tokens=16)
        assert final == expected.text
    finally:
        session.close()


def test_gemma4s_thoughts_fold_into_the_box(tiny_checkpoints, monkeypatch):
    # Gemma 4's markers are special tokens: the chat's answer text keeps them to split on.
    model, processor = mlxvlm.load(tiny_checkpoints.path("gemma4", "hub"))
    tokenizer = processor.tokenizer
    script_tokens(monkeypatch, tokenizer.encode(
        "<|channel>thought\nI think so.<channel|>It is blue.", add_special_tokens=False)
        + [tokenizer.eos_token_id])
    session = ChatSession(model, processor, "tiny-gemma4").start()
    try:
        assert session.thinks is GEMMA4_THINK
        thoughts, answer = replies(session, "What colour?", max_tokens=64)[-1]
    finally:
        session.close()
    assert thoughts["content"] == "I think so." and thoughts["metadata"]["status"] == "done"
    assert answer == {"role": "assistant", "content": "It is blue."}
