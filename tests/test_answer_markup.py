"""A family's answer markup kept in the answer text at every entry point: DeepSeek-OCR 2's
grounding answer pairs each label with its box as ``<|ref|>label<|/ref|><|det|>[[x1, y1,
x2, y2]]<|/det|>``, four special tokens its tokenizer's ``decode`` would drop. The tiny
random checkpoint is made to answer a grounding page (scripted_tokens); each entry point's
text must be transformers' ``decode(ids, skip_special_tokens=False)`` of that answer (the
EOS left out, as every answer leaves it). A family without markup still drops its
special tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import anthropic
import pytest
from scripted_tokens import script_tokens, scripted_environment
from server_harness import png_data_url, user
from server_process import ServerProcess

import mlxvlm
from mlxvlm.text.tokenization import processor_state
from mlxvlm.ui.session import ChatSession
from tiny import make_image

FAMILY = "deepseek_ocr2"
MARKUP = ("<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>")
PROMPT = "<|grounding|>Convert the document to markdown."
# a grounding answer as the model card shows them: each region's label, then its box
ANSWER = ("<|ref|>title<|/ref|><|det|>[[120, 48, 870, 96]]<|/det|>\n# Sales\n\n"
          "<|ref|>text<|/ref|><|det|>[[120, 130, 880, 210]]<|/det|>\nEvery region grew.")
PAGE = make_image(260, 130, seed=1)


@pytest.fixture(scope="module")
def grounding(tiny_checkpoints):
    """(model, processor, answer ids ending with EOS, the text transformers decodes)."""
    model, processor = mlxvlm.load(tiny_checkpoints.path(FAMILY, "hub"))
    tokenizer = processor.tokenizer
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    markup_ids = {tokenizer.convert_tokens_to_ids(t) for t in MARKUP}
    assert markup_ids <= set(ids)  # each marker is one token of the answer
    assert all(tokenizer.added_tokens_decoder[i].special for i in markup_ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) != ANSWER  # decode drops them
    expected = tokenizer.decode(ids, skip_special_tokens=False)
    assert expected == ANSWER
    return model, processor, ids + [tokenizer.eos_token_id], expected


def test_the_family_declares_its_markup_once(grounding, tiny_checkpoints):
    _, processor, _, _ = grounding
    tokenizer = processor.tokenizer
    assert processor_state(processor).answer_markup_ids == {
        tokenizer.convert_tokens_to_ids(t) for t in MARKUP}
    _, other = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))
    assert processor_state(other).answer_markup_ids == frozenset()


def test_the_python_api_keeps_the_markup(grounding, monkeypatch):
    model, processor, script, expected = grounding
    script_tokens(monkeypatch, script)
    question = [user(PROMPT)]
    question[0]["content"].insert(0, {"type": "image"})
    answer = mlxvlm.generate(model, processor, question, PAGE, max_tokens=len(script) + 4)
    assert answer.text == expected and answer.finish_reason == "stop"
    streamed = "".join(r.text for r in mlxvlm.stream_generate(
        model, processor, question, PAGE, max_tokens=len(script) + 4))
    assert streamed == expected
    batch = mlxvlm.batch_generate(model, processor, [PROMPT, "Free OCR."],
                                  max_tokens=len(script) + 4)
    assert [out.text for out in batch] == [expected, expected]


def test_the_chat_ui_keeps_the_markup(grounding, monkeypatch):
    model, processor, script, expected = grounding
    script_tokens(monkeypatch, script)
    session = ChatSession(model, processor, "tiny-ocr").start()
    try:
        final = [reply for reply, _ in session.respond({"text": PROMPT, "files": []}, [],
                                                       max_tokens=len(script) + 4)][-1]
    finally:
        session.close()
    assert final == expected


def test_a_family_without_markup_still_drops_special_tokens(tiny_checkpoints, monkeypatch):
    model, processor = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))
    tokenizer = processor.tokenizer
    special = [i for i, token in tokenizer.added_tokens_decoder.items()
               if token.special and i not in processor_state(processor).eos_token_ids]
    ids = (tokenizer.encode("a", add_special_tokens=False) + special[:2]
           + tokenizer.encode(" box", add_special_tokens=False))
    assert len(special) >= 2
    script_tokens(monkeypatch, ids + [tokenizer.eos_token_id])
    answer = mlxvlm.generate(model, processor, "Where?", max_tokens=len(ids) + 4)
    assert answer.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_cli_keeps_the_markup(grounding, tiny_checkpoints, tmp_path):
    _, _, script, expected = grounding
    image = tmp_path / "page.png"
    PAGE.save(image)
    result = subprocess.run(
        [sys.executable, "-m", "mlxvlm.generate", "--model",
         str(tiny_checkpoints.path(FAMILY, "hub")), "--image", str(image), "--prompt", PROMPT,
         "--max-tokens", str(len(script) + 4)],
        env={**os.environ, **scripted_environment(tmp_path, script)},
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == expected


def test_the_server_keeps_the_markup(grounding, tiny_checkpoints, tmp_path):
    _, _, script, expected = grounding
    messages = [user(PROMPT, png_data_url(PAGE))]
    limit = len(script) + 4
    with ServerProcess("--model", str(tiny_checkpoints.path(FAMILY, "hub")),
                       "--served-model-name", "ocr",
                       env=scripted_environment(tmp_path, script)) as server:
        client = server.openai_client()
        whole = client.chat.completions.create(model="ocr", messages=messages, max_tokens=limit)
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(model="ocr", messages=messages,
                                                        max_tokens=limit, stream=True)
            if chunk.choices)
        response = client.responses.create(model="ocr", input=PROMPT, max_output_tokens=limit)
        claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
        message = claude.messages.create(model="ocr", max_tokens=limit,
                                         messages=[{"role": "user", "content": PROMPT}])
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "stop"
    assert streamed == expected
    assert response.output_text == expected
    assert [(b.type, b.text) for b in message.content] == [("text", expected)]
