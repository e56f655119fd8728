"""Write examples/finetune: a small dataset that teaches the demo model a second question.

    python examples/colour_question.py      # rewrites examples/finetune/train.jsonl and its pictures

The demo model (examples/shapes-vlm) knows one question, "What is in the picture?", and
answers any other with its description of the picture. These records teach it "What
colour is the shape?", answered "It is red."; a third of them ask the question it knows,
so that it keeps answering that one too. Each shows one picture drawn by
``shapes.draw_varied`` (any size and aspect ratio, the shape anywhere): every colour,
shape and background three times. examples/finetune/README.md has the command that
teaches it from them in under a minute.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import shapes  # noqa: E402

QUESTION = "What colour is the shape?"
FOLDER = HERE / "finetune"
SEED = 38


def colour(color: str, shape: str, background: str) -> str:
    return f"It is {color}."


# Two rounds of every picture class ask the new question, one the known one.
ASKS = ((QUESTION, colour), (shapes.QUESTION, shapes.describe), (QUESTION, colour))
RECORDS = len(ASKS) * len(shapes.classes(tuple(shapes.BACKGROUNDS)))


def main() -> int:
    shutil.rmtree(FOLDER / "train-images", ignore_errors=True)
    path = shapes.write_dataset(FOLDER / "train.jsonl", RECORDS, SEED,
                                tuple(shapes.BACKGROUNDS), size=None, asks=ASKS)
    print(f"wrote {RECORDS} records to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
