"""The demo model committed under examples/ (made by examples/teach_shapes.py) answers the
README's first command right, offline; examples/finetune's recipe teaches it a new
question, offline."""

from __future__ import annotations

import random
import shlex
import subprocess
import sys
from pathlib import Path

from mlxvlm import generate, load
from user_environment import user_environment

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import evaluate_shapes  # noqa: E402
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
        env=user_environment(HF_HUB_OFFLINE="1"),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == PICTURES["red-circle.png"]


def documented_commands(readme: Path) -> list[list[str]]:
    """The commands of the first ```bash block of ``readme``, split as a shell would."""
    block = readme.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(command) for command in block.replace("\\\n", " ").splitlines()
            if command.strip()]


def test_offline_finetuning_recipe_teaches_a_new_question(tmp_path):
    """examples/finetune/README.md's commands, as written (the adapter in a temporary
    folder): the adapter answers the new question about pictures it was not taught on
    (examples/evaluate_shapes.py's own drawing code), and still describes them when asked
    what is in them; the model without it never answers the new question."""
    train, show = documented_commands(EXAMPLES / "finetune" / "README.md")
    adapter = str(tmp_path / "colour-adapter")
    env = user_environment(HF_HUB_OFFLINE="1")  # a user's: torch-free
    for command in (train, show):
        assert command[:3] == ["python", "-m", "mlxvlm.finetune" if command is train
                               else "mlxvlm.generate"]
        command[command.index("--adapter-path") + 1] = adapter
    done = subprocess.run([sys.executable, *train[1:]], capture_output=True, text=True,
                          timeout=600, cwd=EXAMPLES.parent, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, *show[1:]], capture_output=True, text=True,
                          timeout=120, cwd=EXAMPLES.parent, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "It is blue."  # examples/images/blue-triangle.png

    question = show[show.index("--prompt") + 1]
    pictures = [evaluate_shapes.draw_fresh(random.Random(500 + i))[0:2] for i in range(12)]
    tuned = load(EXAMPLES / "shapes-vlm", adapter_path=adapter)
    base = load(EXAMPLES / "shapes-vlm")
    colours_right = described_right = base_colours = 0
    for image, (colour, shape, background) in pictures:
        answer = generate(*tuned, question, image=image, max_tokens=8).text.strip()
        colours_right += answer == f"It is {colour}."
        described = generate(*tuned, evaluate_shapes.QUESTION, image=image, max_tokens=16)
        described_right += described.text.strip() == evaluate_shapes.describe(colour, shape,
                                                                              background)
        base_colours += generate(*base, question, image=image,
                                 max_tokens=8).text.strip().startswith("It is")
    assert len({label[0] for _, label in pictures}) == 4  # every colour asked about
    assert colours_right >= 11, colours_right
    assert described_right >= 11, described_right
    assert base_colours == 0
