"""PaddleOCR-VL through the batching engine and the OpenAI-compatible server: the tiny
checkpoint's long answers (64 greedy tokens) are transformers' own when prompts are
decoded together and when an image arrives as a data URL, alone or beside another
request, and a later turn reuses the cached prefix of the earlier one."""

from __future__ import annotations

import threading

import pytest
from server_harness import MODEL_ID, LiveServer, png_data_url, user

from parity import loaded  # noqa: F401 (fixture)
from test_paddleocr_vl_parity import ALL_CASES, CASES, FAMILY, IMAGE_A, IMAGE_TALL, NEW_TOKENS
from test_paddleocr_vl_parity import reference  # noqa: F401 (fixture)

import mlxvlm

pytest.importorskip("torch")

GREEDY = {"temperature": 0, "max_tokens": NEW_TOKENS}


def test_batched_prompts_get_transformers_tokens(loaded, reference):
    """Text, one and two images of different sizes and a later-turn image, decoded in
    one batch (rows of different lengths and M-RoPE deltas)."""
    model, processor = loaded(FAMILY, "hub")
    names = ["text", "one_image", "two_images", "image_in_second_turn", "large_and_tall_images"]
    outputs = mlxvlm.batch_generate(
        model, processor, [ALL_CASES[n][0] for n in names], [ALL_CASES[n][1] or None for n in names],
        max_tokens=NEW_TOKENS, temperature=0.0,
    )
    assert [o.tokens for o in outputs] == [reference(n).tokens for n in names]


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(*loaded(FAMILY, "hub")) as live:
        yield live


def chat(client, messages):
    return client.chat.completions.create(model=MODEL_ID, messages=messages, **GREEDY)


def expected_text(loaded, case: str) -> str:
    model, processor = loaded(FAMILY, "hub")
    result = mlxvlm.generate(model, processor, ALL_CASES[case][0], ALL_CASES[case][1],
                             max_tokens=NEW_TOKENS)
    return result.text, result.tokens


def test_server_answers_an_ocr_request_as_transformers(server, loaded, reference):
    """An image as a data URL: the answer is generate's, whose tokens are transformers'."""
    text, tokens = expected_text(loaded, "one_image")
    assert tokens == reference("one_image").tokens
    response = chat(server.client(), [user("Describe this image.", png_data_url(IMAGE_A))])
    assert response.choices[0].message.content == text
    assert response.usage.completion_tokens == NEW_TOKENS


def test_concurrent_requests_each_get_their_own_answer(server, loaded):
    """Two requests with different images in flight at once (one batched decode)."""
    cases = {"one_image": [user("Describe this image.", png_data_url(IMAGE_A))],
             "tall_image": [user("OCR:", png_data_url(IMAGE_TALL))]}
    answers = {}

    def ask(case):
        answers[case] = chat(server.client(), cases[case]).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(case,)) for case in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers == {case: expected_text(loaded, case)[0] for case in cases}


def test_later_turn_with_an_image_reuses_the_prefix(server, loaded, reference):
    """The second request repeats the first's turn and adds an image turn: the answer is
    transformers' for the whole conversation (prefix reuse keeps M-RoPE positions)."""
    messages, _ = CASES["image_in_second_turn"]
    first = [messages[0]]
    client = server.client()
    chat(client, first)
    later = [messages[0], messages[1], user("What is in this picture?", png_data_url(ALL_CASES["image_in_second_turn"][1][0]))]
    text, tokens = expected_text(loaded, "image_in_second_turn")
    assert tokens == reference("image_in_second_turn").tokens
    assert chat(client, later).choices[0].message.content == text
