"""Small datasets and settings shared by the fine-tuning tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tiny import make_image

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))  # shapes.py and tiny_vlm.py, the demo's own pieces

ANSWERS = ["A red cat.", "A blue mat and a green plant.", "The quick brown fox.", "A small house."]


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def image_file(directory: Path, name: str, width: int = 56, height: int = 56, seed: int = 0) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    make_image(width, height, seed=seed).save(directory / name)
    return name


def one_image_record(image: str, answer: str, question: str = "Describe this image.") -> dict:
    """TRL's layout: an image part without a source, the image in `images`."""
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "images": [image],
    }


def small_dataset(directory: Path, count: int = 6, seed: int = 0) -> Path:
    """``count`` one-image records (images of two sizes) in ``directory/train.jsonl``."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        width, height = (56, 56) if i % 2 else (84, 56)
        name = image_file(directory / "images", f"{i}.png", width, height, seed=int(rng.integers(1 << 30)))
        records.append(one_image_record(f"images/{name}", ANSWERS[i % len(ANSWERS)]))
    return write_jsonl(directory / "train.jsonl", records)
