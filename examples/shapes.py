"""Synthetic pictures of coloured shapes, and a JSONL dataset of them for fine-tuning.

Each picture is one shape (circle, square or triangle) in one colour on a plain
background, drawn at a slightly random size and place; its description names all three:
"a red circle on a white background". A model can only give it by looking at the image.
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


def describe(color: str, shape: str, background: str = "white") -> str:
    return f"a {color} {shape} on a {background} background"


def classes(backgrounds=("white",)) -> list[tuple[str, str, str]]:
    return [(c, s, b) for b in backgrounds for c in COLORS for s in SHAPES]


def conversation(answer: str | None = None) -> list[dict]:
    """The question about one image, and the answer when given."""
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": QUESTION}]}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return messages


def write_dataset(path: str | Path, count: int, seed: int, backgrounds=("white",),
                  size: int = 56) -> Path:
    """``count`` pictures (the classes in turn; training shuffles them) as PNGs beside
    ``path``, and the JSONL records asking about them."""
    path = Path(path)
    image_dir = path.parent / f"{path.stem}-images"
    image_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = classes(backgrounds)
    with open(path, "w") as file:
        for i in range(count):
            color, shape, background = labels[i % len(labels)]
            name = f"{image_dir.name}/{i:05d}.png"
            draw(color, shape, background, size, rng).save(path.parent / name)
            record = {"messages": conversation(describe(color, shape, background)),
                      "images": [name]}
            file.write(json.dumps(record) + "\n")
    return path
