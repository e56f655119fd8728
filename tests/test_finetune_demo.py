"""The demo model committed under examples/ (made by examples/teach_shapes.py) answers the
README's first command right, offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlxvlm import generate, load

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PICTURES = {
    "red-circle.png": "a red circle on a white background",
    "blue-triangle.png": "a blue triangle on a black background",
    "yellow-square.png": "a yellow square on a gray background",
}


def test_demo_model_describes_the_example_pictures():
    model, processor = load(EXAMPLES / "shapes-vlm")
    for name, description in PICTURES.items():
        answer = generate(model, processor, "What is in the picture?",
                          image=EXAMPLES / "images" / name, max_tokens=16)
        assert answer.text.strip() == description, name


def test_readme_first_command():
    done = subprocess.run(
        [sys.executable, "-m", "mlxvlm.generate", "--model", "examples/shapes-vlm",
         "--image", "examples/images/red-circle.png", "--prompt", "What is in the picture?"],
        capture_output=True, text=True, timeout=120, cwd=EXAMPLES.parent,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == PICTURES["red-circle.png"]
