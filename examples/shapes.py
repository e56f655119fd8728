"""Synthetic pictures of coloured shapes, and a JSONL dataset of them for fine-tuning.

Each picture is one shape (circle, square or triangle) in one colour on a plain
background; its description names all three: "a red circle on a white background". A
model can only give it by looking at the image.

``draw`` makes the tidy example pictures (square, the shape centred and 4/5 as wide);
``draw_varied`` the training ones, which vary everything a user's own picture may: its
sides (48-480 px each, so any aspect ratio), the shape's size (22-94% of the shorter
side) and place (anywhere), its proportions (ellipses and rectangles up to 1.7:1,
triangles of many kinds), its colour (jittered around the palette) and the background's,
outlines and anti-aliasing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS = {"white": (255, 255, 255), "black": (15, 15, 15), "gray": (128, 128, 128)}
QUESTION = "What is in the picture?"


def draw(color: str, shape: str, background: str = "white", size: int = 56,
         rng: np.random.Generator | None = None) -> Image.Image:
    """One shape, about four fifths of the picture wide, jittered a little in size and
    place. The square fills the circle's bounding box, so the three shapes differ in
    area (4 : 3.1 : 1.7) as well as in outline."""
    rng = rng or np.random.default_rng(0)
    image = Image.new("RGB", (size, size), BACKGROUNDS[background])
    pen = ImageDraw.Draw(image)
    radius = rng.uniform(0.37, 0.42) * size
    cx, cy = size / 2 + rng.uniform(-0.04, 0.04, size=2) * size
    fill = COLORS[color]
    if shape == "circle":
        pen.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=fill)
    elif shape == "square":
        pen.rectangle([cx - radius, cy - radius, cx + radius, cy + radius], fill=fill)
    elif shape == "triangle":
        pen.polygon([(cx, cy - radius), (cx - 0.95 * radius, cy + 0.8 * radius),
                     (cx + 0.95 * radius, cy + 0.8 * radius)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return image


def _jitter(rgb, amount: float, rng: np.random.Generator) -> tuple[int, ...]:
    return tuple(int(v) for v in np.clip(np.add(rgb, rng.uniform(-amount, amount, 3)), 0, 255))


def _triangle(rng: np.random.Generator, box) -> list[tuple[float, float]]:
    """A triangle filling ``box``: isosceles pointing up, down, left or right (up most
    often, as most people draw one), right-angled, or with a free apex on one side."""
    x0, y0, x1, y1 = box
    kind = rng.choice(["up", "up", "down", "left", "right", "right-angle", "free"])
    if kind == "up":
        return [((x0 + x1) / 2, y0), (x1, y1), (x0, y1)]
    if kind == "down":
        return [(x0, y0), (x1, y0), ((x0 + x1) / 2, y1)]
    if kind == "left":
        return [(x0, (y0 + y1) / 2), (x1, y0), (x1, y1)]
    if kind == "right":
        return [(x0, y0), (x1, (y0 + y1) / 2), (x0, y1)]
    corners = [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    if kind == "right-angle":
        del corners[rng.integers(4)]
        return corners
    apex = x0 + rng.uniform(0.15, 0.85) * (x1 - x0)
    return [(apex, y0), (x1, y1), (x0, y1)] if rng.random() < 0.5 else \
           [(apex, y1), (x1, y0), (x0, y0)]


def draw_varied(color: str, shape: str, background: str, rng: np.random.Generator,
                easy: bool = False) -> Image.Image:
    """One training picture: everything about it random except what it shows. ``easy``
    ones (for a first stage of training) are 96-256 px a side and the shape 60-94% of
    the shorter one, so that an untrained model finds it in every image token."""
    low, high, smallest = (96, 257, 0.6) if easy else (48, 481, 0.22)
    width, height = (int(v) for v in rng.integers(low, high, size=2))
    side = rng.uniform(smallest, 0.94) * min(width, height)
    w = h = side
    if shape != "triangle" and rng.random() < 0.35:  # an ellipse or a rectangle
        stretch = rng.uniform(1.1, 1.7)
        if rng.random() < 0.5:
            w = min(side * stretch, 0.97 * width)
        else:
            h = min(side * stretch, 0.97 * height)
    elif shape == "triangle":  # its width and height free within 0.75-1.35 of each other
        w = min(side * rng.uniform(0.8, 1.35), 0.97 * width)
    # PIL draws no anti-aliased edges; drawing larger and shrinking makes them.
    scale = min(int(rng.choice([1, 1, 2, 4])), max(1, 960 // max(width, height)))
    x0, y0 = rng.uniform(0, width - w), rng.uniform(0, height - h)
    box = [v * scale for v in (x0, y0, x0 + w, y0 + h)]
    image = Image.new("RGB", (width * scale, height * scale),
                      _jitter(BACKGROUNDS[background], 20, rng))
    pen = ImageDraw.Draw(image)
    fill = _jitter(COLORS[color], 45, rng)
    outline, line = None, 1
    if rng.random() < 0.3:
        darker, lighter = tuple(c // 2 for c in fill), tuple((c + 255) // 2 for c in fill)
        outline = [(0, 0, 0), (255, 255, 255), darker, lighter][rng.integers(4)]
        line = int(rng.integers(1, 5)) * scale
    if shape == "circle":
        if rng.random() < 0.7:
            pen.ellipse(box, fill=fill, outline=outline, width=line)
        else:  # a polygon of many sides, as some drawing code makes circles
            n = int(rng.integers(20, 64))
            cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
            rx, ry = (box[2] - box[0]) / 2, (box[3] - box[1]) / 2
            angles = np.linspace(0, 2 * np.pi, n, endpoint=False) + rng.uniform(0, np.pi)
            pen.polygon([(cx + rx * np.cos(a), cy + ry * np.sin(a)) for a in angles],
                        fill=fill, outline=outline, width=line)
    elif shape == "square":
        pen.rectangle(box, fill=fill, outline=outline, width=line)
    elif shape == "triangle":
        pen.polygon(_triangle(rng, box), fill=fill, outline=outline, width=line)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    if scale > 1:
        image = image.resize((width, height), Image.LANCZOS)
    return image


def describe(color: str, shape: str, background: str = "white") -> str:
    return f"a {color} {shape} on a {background} background"


def classes(backgrounds=("white",)) -> list[tuple[str, str, str]]:
    return [(c, s, b) for b in backgrounds for c in COLORS for s in SHAPES]


def conversation(answer: str | None = None, question: str = QUESTION) -> list[dict]:
    """The question about one image, and the answer when given."""
    return chat([True], [answer], question=question)


def chat(pictured, answers, text_first=(), question: str = QUESTION) -> list[dict]:
    """A conversation of turns asking the question, each bringing a new picture
    (``pictured[k]``) or not (asking again about the latest one), each answered by
    ``answers[k]`` (None leaves a turn unanswered: the last one, to be generated). A turn
    listed in ``text_first`` puts the question before its picture, as some clients send
    it."""
    messages = []
    for turn, (picture, answer) in enumerate(zip(pictured, answers, strict=True)):
        text = {"type": "text", "text": question}
        if not picture:
            content = question
        elif turn in text_first:
            content = [text, {"type": "image"}]
        else:
            content = [{"type": "image"}, text]
        messages.append({"role": "user", "content": content})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    return messages


def write_dataset(path: str | Path, count: int, seed: int, backgrounds=("white",),
                  size: int | None = 56, easy: bool = False,
                  asks=((QUESTION, describe),)) -> Path:
    """``count`` pictures (the classes in turn; training shuffles them) as PNGs beside
    ``path``, and the JSONL records asking about them: ``draw``'s tidy ones of ``size``
    pixels, or ``draw_varied``'s (``easy`` or not) with ``size=None``. Each round of the
    classes asks the next of ``asks``, (question, answer(colour, shape, background))."""
    path = Path(path)
    image_dir = path.parent / f"{path.stem}-images"
    image_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = classes(backgrounds)
    with open(path, "w") as file:
        for i in range(count):
            color, shape, background = labels[i % len(labels)]
            name = f"{image_dir.name}/{i:05d}.png"
            image = (draw_varied(color, shape, background, rng, easy) if size is None
                     else draw(color, shape, background, size, rng))
            image.save(path.parent / name, optimize=True)
            question, answer = asks[i // len(labels) % len(asks)]
            record = {"messages": conversation(answer(color, shape, background), question),
                      "images": [name]}
            file.write(json.dumps(record) + "\n")
    return path
