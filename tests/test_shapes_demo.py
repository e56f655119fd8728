"""The committed demo model (examples/shapes-vlm) describes pictures a user might draw,
not only ones like its training pictures: freshly drawn by examples/evaluate_shapes.py
(its own drawing code), square and long, small and large, the shape anywhere and
35-85% of the shorter side, jittered colours, outlines and anti-aliasing; and in a chat,
through mlxvlm.generate and the server, it answers about the newest picture."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from mlxvlm import generate, load

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import evaluate_shapes  # noqa: E402

from server_process import ServerProcess  # noqa: E402

# (width, height), (colour, shape, background): every shape, colour and background, and
# the sizes the README's users tried (a 300 x 300 square, a 180 x 120 circle).
CASES = [
    ((300, 300), ("green", "square", "white")),
    ((180, 120), ("red", "circle", "white")),
    ((64, 64), ("blue", "triangle", "black")),
    ((448, 448), ("yellow", "circle", "gray")),
    ((448, 64), ("red", "square", "gray")),
    ((64, 448), ("green", "triangle", "white")),
    ((100, 300), ("blue", "circle", "white")),
    ((400, 150), ("yellow", "triangle", "black")),
    ((256, 200), ("green", "circle", "black")),
    ((96, 160), ("red", "triangle", "gray")),
    ((333, 222), ("blue", "square", "gray")),
    ((144, 377), ("yellow", "square", "black")),
]


@pytest.fixture(scope="module")
def demo():
    return load(EXAMPLES / "shapes-vlm")


def test_demo_describes_freshly_drawn_pictures(demo):
    model, processor = demo
    wrong = []
    for i, (size, label) in enumerate(CASES):
        image, label = evaluate_shapes.draw_fresh(random.Random(1000 + i), label, size)
        answer = generate(model, processor, evaluate_shapes.QUESTION, image=image,
                          max_tokens=16).text.strip()
        if answer != evaluate_shapes.describe(*label):
            wrong.append(f"{size}: {label} -> {answer!r}")
    assert len(wrong) <= 1, wrong


# Chats of two pictures, the second unlike the first in colour, shape and background
# (the case first): the answer to the second turn describes the second picture.
CHATS = [
    (("yellow", "circle", "black"), ("green", "square", "white")),
    (("red", "triangle", "white"), ("blue", "circle", "gray")),
    (("green", "circle", "gray"), ("yellow", "triangle", "black")),
    (("blue", "square", "black"), ("red", "circle", "white")),
    (("yellow", "square", "white"), ("green", "triangle", "gray")),
    (("red", "circle", "gray"), ("blue", "triangle", "black")),
]


def picture(label, seed: int, size=(200, 160)):
    return evaluate_shapes.draw_fresh(random.Random(seed), label, size)[0]


def test_demo_answers_about_the_newest_picture(demo):
    """A later turn bringing a new picture is answered about it, and a turn asking again
    without one about the newest picture too."""
    model, processor = demo
    wrong = []
    for i, (first, second) in enumerate(CHATS):
        images = [picture(first, 2000 + i), picture(second, 3000 + i)]
        messages = evaluate_shapes.chat_turn([], picture=True)
        messages.append({"role": "assistant", "content": evaluate_shapes.describe(*first)})
        messages = evaluate_shapes.chat_turn(messages, picture=True)
        answer = generate(model, processor, messages, image=images, max_tokens=16).text.strip()
        messages.append({"role": "assistant", "content": answer})
        again = generate(model, processor, evaluate_shapes.chat_turn(messages, picture=False),
                         image=images, max_tokens=16).text.strip()
        for said in (answer, again):
            if said != evaluate_shapes.describe(*second):
                wrong.append(f"{first} then {second} -> {said!r}")
    assert len(wrong) <= 1, wrong


def data_url(image) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_server_chat_answers_about_the_newest_picture():
    """Through ``python -m mlxvlm.server`` and the OpenAI client, as a user chats: turn 1
    a yellow circle, turn 2 a green square, each answer kept in the history."""
    first, second = CHATS[0]
    history = []
    model = str(EXAMPLES / "shapes-vlm")
    with ServerProcess("--model", model) as server:
        client = server.openai_client()
        for label, seed in ((first, 2000), (second, 3000)):
            history.append({"role": "user", "content": [
                {"type": "text", "text": evaluate_shapes.QUESTION},
                {"type": "image_url", "image_url": {"url": data_url(picture(label, seed))}}]})
            reply = client.chat.completions.create(model=model, messages=history,
                                                   max_tokens=16)
            answer = reply.choices[0].message.content.strip()
            assert answer == evaluate_shapes.describe(*label), (label, answer)
            history.append({"role": "assistant", "content": answer})


def test_generation_config_is_greedy():
    config = json.loads((EXAMPLES / "shapes-vlm" / "generation_config.json").read_text())
    assert config["do_sample"] is False
    model_config = json.loads((EXAMPLES / "shapes-vlm" / "config.json").read_text())
    assert config["eos_token_id"] == model_config["eos_token_id"]


def test_model_card_names_the_vocabulary():
    card = (EXAMPLES / "shapes-vlm" / "README.md").read_text()
    for word in (*evaluate_shapes.COLORS, *evaluate_shapes.SHAPES, *evaluate_shapes.BACKGROUNDS):
        assert word in card, word


def test_evaluation_counts_each_part_of_an_answer():
    """--show-errors' shares: each word is judged on its own, against describe's form."""
    label = ("red", "circle", "white")
    assert evaluate_shapes.parts_right(evaluate_shapes.describe(*label), label) == (True, True, True)
    assert evaluate_shapes.parts_right(evaluate_shapes.describe("red", "square", "white"),
                                       label) == (True, False, True)
    assert evaluate_shapes.parts_right(evaluate_shapes.describe("blue", "circle", "gray"),
                                       label) == (False, True, False)
    for garbled in ("", "a red circle", "a red circle on a white background background",
                    "the red circle on a white background"):
        assert evaluate_shapes.parts_right(garbled, label) == (False, False, False), garbled


def test_tiny_vlm_builds_the_tower_it_is_asked_for(tmp_path):
    """build_checkpoint's patch_size reaches the image processor too, so the checkpoint
    loads and answers about a picture (a processor left at 14-px patches would hand the
    7-px patch embedding rows four times too long)."""
    import tiny_vlm

    corpus = [evaluate_shapes.describe("red", "circle", "white"), evaluate_shapes.QUESTION]
    path = tiny_vlm.build_checkpoint(tmp_path / "model", corpus * 4, pixels=56 * 56,
                                     patch_size=7, vision_heads=1)
    vision = json.loads((path / "config.json").read_text())["vision_config"]
    assert (vision["patch_size"], vision["num_heads"]) == (7, 1)
    model, processor = load(path)
    image, _ = evaluate_shapes.draw_fresh(random.Random(0), ("red", "circle", "white"), (56, 56))
    grid = processor.image_processor(images=[image], return_tensors="np")["image_grid_thw"]
    assert grid.tolist() == [[1, 8, 8]]
    result = generate(model, processor, evaluate_shapes.QUESTION, image=image, max_tokens=2)
    assert result.prompt_tokens > 16  # the 16 merged image tokens and the question
