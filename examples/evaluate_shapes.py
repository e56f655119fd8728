"""How often the shapes demo describes fresh pictures right: draws N pictures unlike the
training ones and runs each through ``mlxvlm.load`` / ``generate`` (greedy).

    python examples/evaluate_shapes.py                      # 200 pictures, seed 1234
    python examples/evaluate_shapes.py -n 500 --seed 7 --show-errors
    python examples/evaluate_shapes.py --turns 2            # a chat: the second picture
    python examples/evaluate_shapes.py --turns 2 --ask-again

With ``--turns N`` each of the ``-n`` conversations brings a new picture in each of N
turns (each unlike the one before it), the model's own answers kept in the history as a
chat keeps them, and what is scored is the last answer, about the newest picture;
``--ask-again`` adds a turn without a picture asking the question again, whose answer
must still be about the newest picture. ``--text-first`` puts each question before its
picture, as OpenAI clients often send it.

The pictures come from their own drawing code, not examples/shapes.py, so that the
figure says how the model does on pictures it was not made from: Python's ``random``
rather than numpy's generator; sides of 64-448 px each (any aspect ratio between);
the shape 35-85% as wide as the picture's shorter side, anywhere in it; circles drawn as
PIL ellipses, as many-sided polygons or as ellipses up to 1.5 times wider than tall,
squares as rectangles, as four-point polygons or as rectangles up to 1.5:1, triangles
upright, upside down, or as ``regular_polygon``; some anti-aliased (drawn at 4x, then
downsampled), some with an outline; the colour jittered up to 35 per channel and the
background up to 12.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import sys
import time
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent

COLORS = {  # the palette the model was taught (examples/shapes.py), restated here
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
}
BACKGROUNDS = {"white": (255, 255, 255), "black": (15, 15, 15), "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What is in the picture?"


def _jitter(rgb, amount: int, rng: random.Random) -> tuple[int, int, int]:
    return tuple(min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)


def _outline_points(shape: str, variant: int, box, rng: random.Random):
    """The polygon (or None for PIL's own ellipse / rectangle) of one shape in ``box``."""
    x0, y0, x1, y1 = box
    cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
    if shape == "circle" and variant == 1:
        n = rng.randint(24, 48)
        return [(cx + rx * math.cos(2 * math.pi * k / n), cy + ry * math.sin(2 * math.pi * k / n))
                for k in range(n)]
    if shape == "square" and variant == 1:
        return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    if shape == "triangle":
        if variant == 0:  # apex up
            return [(cx, y0), (x1, y1), (x0, y1)]
        if variant == 1:  # apex down
            return [(x0, y0), (x1, y0), (cx, y1)]
        # an equilateral one, as regular_polygon draws it, fitted to the box's height
        r = min(rx, ry / 0.75)
        return [(cx + r * math.sin(a), cy + 0.25 * r - r * math.cos(a))
                for a in (0, 2 * math.pi / 3, 4 * math.pi / 3)]
    return None


def draw_fresh(rng: random.Random, label: tuple[str, str, str] | None = None,
               size: tuple[int, int] | None = None):
    """One random picture and its (colour, shape, background); ``label`` and ``size``
    (width, height) fix those."""
    color = label[0] if label else rng.choice(list(COLORS))
    shape = label[1] if label else rng.choice(SHAPES)
    background = label[2] if label else rng.choice(list(BACKGROUNDS))
    width, height = size or (rng.randint(64, 448), rng.randint(64, 448))
    scale = 4 if rng.random() < 0.4 else 1  # anti-aliased: drawn at 4x, then downsampled
    side = rng.uniform(0.35, 0.85) * min(width, height)
    variant = rng.randrange(3)
    w = h = side
    if variant == 2 and shape != "triangle":  # an ellipse or a rectangle, up to 1.5:1
        stretch = rng.uniform(1.15, 1.5)
        if rng.random() < 0.5 and side * stretch <= 0.95 * width:
            w = side * stretch
        elif side * stretch <= 0.95 * height:
            h = side * stretch
    x0 = rng.uniform(0, width - w)
    y0 = rng.uniform(0, height - h)
    box = [v * scale for v in (x0, y0, x0 + w, y0 + h)]

    image = Image.new("RGB", (width * scale, height * scale),
                      _jitter(BACKGROUNDS[background], 12, rng))
    pen = ImageDraw.Draw(image)
    fill = _jitter(COLORS[color], 35, rng)
    outline, line = None, 0
    if rng.random() < 0.3:
        outline = rng.choice([(0, 0, 0), (255, 255, 255), tuple(c // 2 for c in fill)])
        line = rng.randint(1, 3) * scale
    points = _outline_points(shape, variant, box, rng)
    if points is not None:
        pen.polygon(points, fill=fill, outline=outline, width=max(line, 1))
    elif shape == "circle":
        pen.ellipse(box, fill=fill, outline=outline, width=max(line, 1))
    else:
        pen.rectangle(box, fill=fill, outline=outline, width=max(line, 1))
    if scale > 1:
        image = image.resize((width, height), Image.LANCZOS)
    return image, (color, shape, background)


def describe(color: str, shape: str, background: str) -> str:
    return f"a {color} {shape} on a {background} background"


def parts_right(answer: str, label: tuple[str, str, str]) -> tuple[bool, bool, bool]:
    """Whether ``answer`` names the label's colour, shape and background, each on its own;
    an answer not in ``describe``'s form names none of them."""
    said = re.fullmatch(describe(*([r"(\S+)"] * 3)), answer.strip())
    return tuple(bool(said) and said.group(k + 1) == label[k] for k in range(3))


def chat_turn(messages: list, picture: bool, text_first: bool = False) -> list:
    """``messages`` with one more user turn asking the question, bringing a picture (after
    the question with ``text_first``) or not."""
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}] if picture else QUESTION
    if picture and text_first:
        content.reverse()
    return messages + [{"role": "user", "content": content}]


def evaluate(model_path, count: int, seed: int, show_errors: bool = False, turns: int = 1,
             ask_again: bool = False, text_first: bool = False) -> dict:
    """The share of ``count`` fresh pictures described exactly right (``score``), and of
    their colours, shapes and backgrounds named right, with ``count`` and ``seed``. With
    ``turns`` > 1 (or ``ask_again``) each is the newest picture of a chat (see the
    module's help), and ``earlier`` is the share of answers that described an earlier
    picture instead."""
    from mlxvlm import generate, load

    model, processor = load(model_path)
    rng = random.Random(seed)
    right = earlier = 0
    parts = [0, 0, 0]  # colour, shape, background right
    for i in range(count):
        messages, images, labels = [], [], []
        for turn in range(turns):
            while True:  # a new picture: not the one before it again
                image, label = draw_fresh(rng)
                if not labels or label != labels[-1]:
                    break
            images.append(image)
            labels.append(label)
            messages = chat_turn(messages, picture=True, text_first=text_first)
            answer = generate(model, processor, messages, image=images, max_tokens=16).text.strip()
            messages.append({"role": "assistant", "content": answer})
        if ask_again:
            messages = chat_turn(messages, picture=False)
            answer = generate(model, processor, messages, image=images, max_tokens=16).text.strip()
        expected = describe(*labels[-1])
        right += answer == expected
        earlier += answer in {describe(*label) for label in labels[:-1]} - {expected}
        for k, said in enumerate(parts_right(answer, labels[-1])):
            parts[k] += said
        if show_errors and answer != expected:
            print(f"  #{i} {image.width}x{image.height}: expected {expected!r}, got {answer!r}")
    colour, shape, background = (p / count for p in parts)
    result = dict(score=right / count, colour=colour, shape=shape, background=background,
                  count=count, seed=seed, turns=turns, ask_again=ask_again,
                  text_first=text_first)
    if turns > 1:
        result["earlier"] = earlier / count
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=str(HERE / "shapes-vlm"), help="The model to measure")
    parser.add_argument("-n", "--count", type=int, default=200,
                        help="Pictures (with --turns, conversations) to draw")
    parser.add_argument("--seed", type=int, default=1234, help="Seed of the pictures")
    parser.add_argument("--turns", type=int, default=1,
                        help="Turns of a chat, each with a new picture; the last is scored")
    parser.add_argument("--ask-again", action="store_true",
                        help="Then ask again without a picture, and score that answer")
    parser.add_argument("--text-first", action="store_true",
                        help="Put each question before its picture")
    parser.add_argument("--show-errors", action="store_true",
                        help="Print each wrong answer with the picture's size")
    args = parser.parse_args()
    if args.count < 1:
        parser.error("-n/--count must be at least 1")
    if args.turns < 1:
        parser.error("--turns must be at least 1")
    tic = time.perf_counter()
    result = evaluate(args.model, args.count, args.seed, args.show_errors, args.turns,
                      args.ask_again, args.text_first)
    print(summary(result) + f", {time.perf_counter() - tic:.0f} s")
    return 0


def summary(result: dict) -> str:
    """One line saying what was measured and how it went."""
    what = "fresh pictures"
    if result["turns"] > 1 or result["ask_again"]:
        pictures = "picture" if result["turns"] == 1 else "pictures"
        what = f"chats of {result['turns']} {pictures}" + (
            " and a question again" if result["ask_again"] else "")
    if result["text_first"]:
        what += " (each question before its picture)"
    line = ("{score:.1%} of {count} " + what + " described exactly right (seed {seed}): "
            "colour {colour:.1%}, shape {shape:.1%}, background {background:.1%}").format(**result)
    if "earlier" in result:
        line += f"; {result['earlier']:.1%} described an earlier picture instead"
    return line


if __name__ == "__main__":
    sys.exit(main())
