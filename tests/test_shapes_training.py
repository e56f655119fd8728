"""examples/teach_shapes.py's two stages: the tower's readout reads each picture of a
batch on its own, the language model's batched loss is the loss mlxvlm.finetune takes
one sequence at a time, and the whole recipe runs, on a few pictures, to a checkpoint
that loads and answers greedily."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxvlm import load
from mlxvlm.finetune.trainer import model_inputs, sequence_loss

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import shape_tower  # noqa: E402
import shape_words  # noqa: E402
import shapes  # noqa: E402
import teach_shapes  # noqa: E402
import tiny_vlm  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    corpus = [shapes.describe(*c) for c in shapes.classes(tuple(shapes.BACKGROUNDS))]
    path = tiny_vlm.build_checkpoint(
        tmp_path_factory.mktemp("shapes") / "base", corpus + [shapes.QUESTION], seed=3,
        pixels=64 * 64, patch_size=8, vision_width=32, vision_depth=1)
    return load(path)


def test_readout_reads_each_picture_of_a_batch_alone(tiny):
    model, processor = tiny
    mx.random.seed(0)
    readout = shape_tower.Readout(model.vision_tower.config.out_hidden_size)
    pool = shape_tower._draw_chunk(5, 6, 64 * 64, 16)
    grids = {tuple(processor.image_processor(images=[p], return_tensors="np")
                   ["image_grid_thw"][0]) for p, _ in pool}
    assert len(grids) > 1  # pictures of several shapes of grid share the batch

    def logits(batch):
        inputs = processor.image_processor(images=[p for p, _ in batch], return_tensors="np")
        grid = np.asarray(inputs["image_grid_thw"])
        tokens = model.vision_tower(mx.array(inputs["pixel_values"]), grid)
        owner = mx.array(np.repeat(np.arange(len(batch)), grid.prod(axis=1) // 4))
        return readout(tokens, owner, len(batch))

    together = logits(pool)
    for i, item in enumerate(pool):
        alone = logits([item])
        for question, answer in zip(together, alone):
            np.testing.assert_allclose(np.array(question[i]), np.array(answer[0]),
                                       rtol=1e-5, atol=1e-5)


def test_batched_words_loss_is_finetunes_loss(tiny):
    """A group's rows through the language model as one (B, L) batch: the mean loss per
    answer token of mlxvlm.finetune's one-sequence-at-a-time loss over them."""
    model, processor = tiny
    encoded = list(shape_words.conversations(processor, 24, seed=4))
    groups = shape_words.group_conversations(model, encoded, log=lambda _: None)
    assert sorted(m for g in groups for m in g.members) == list(range(24))
    assert max(len(g.members) for g in groups) > 1  # some batch has several rows
    for group in groups:
        batched = shape_words.batch_loss(model.language_model, group,
                                         mx.arange(len(group.members))).item()
        total = answer_tokens = 0.0
        for member in group.members:
            input_ids, loss_mask, features = model_inputs(model, encoded[member])
            total += sequence_loss(model, input_ids, loss_mask, features).item()
            answer_tokens += loss_mask[1:].sum().item()
        assert batched == pytest.approx(total / answer_tokens, rel=1e-5)


# Run in a fresh process (and its spawned picture workers) where torch is absent, as in
# a plain ``pip install -e .``: sitecustomize marks torch and its companions missing, so
# ``import torch`` fails and ``find_spec`` says "not installed", as without the package.
NO_TORCH = "import sys\nfor name in ('torch', 'torchvision', 'torchaudio'):\n    sys.modules[name] = None\n"

RECIPE = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, EXAMPLES)
import shapes, teach_shapes
from mlxvlm import generate, load

args = SimpleNamespace(seed=1, text_layers=1, tower_steps=3, tower_pictures=32,
                       words_steps=3, words_pictures=16)
final, facts = teach_shapes.teach(Path(WORK), args)
model, processor = load(final)
result = generate(model, processor, shapes.QUESTION, image=shapes.draw("red", "circle"),
                  max_tokens=3)
card = teach_shapes.CARD.format(**facts, score=0.5, colour=1, shape=0.5, background=1,
                                count=10, seed=2)
print("RESULT " + json.dumps(dict(
    generation_config=json.loads((final / "generation_config.json").read_text()),
    config=json.loads((final / "config.json").read_text()),
    generation_tokens=result.generation_tokens, facts=facts, card=card,
    torch_loaded="torch" in sys.modules and sys.modules["torch"] is not None)))
"""


def test_the_recipe_runs_to_a_greedy_checkpoint_without_torch(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NO_TORCH)
    env = {k: v for k, v in os.environ.items() if k != "MLXVLM_ALLOW_TORCH"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    script = f"EXAMPLES = {str(EXAMPLES)!r}\nWORK = {str(tmp_path / 'work')!r}\n" + RECIPE
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["generation_config"]["do_sample"] is False
    assert out["generation_config"]["eos_token_id"] == out["config"]["eos_token_id"]
    assert out["generation_tokens"] >= 1
    assert out["facts"]["tower_steps"] == 3 and out["facts"]["minutes"] > 0
    assert "cores of" in out["card"] and "10 fresh pictures" in out["card"]
    assert out["torch_loaded"] is False


@pytest.mark.parametrize("flag, value, message", [
    ("--tower-steps", "1", "--tower-steps must be at least 2"),
    ("--words-steps", "0", "--words-steps must be at least 2"),
    ("--tower-pictures", "0", "--tower-pictures must be at least 1"),
    ("--words-pictures", "-3", "--words-pictures must be at least 1"),
    ("--text-layers", "0", "--text-layers must be at least 1"),
])
def test_teach_shapes_refuses_options_out_of_range(monkeypatch, capsys, flag, value, message):
    """Before any work (no model is built): argparse's one-line usage error, exit 2."""
    monkeypatch.setattr(sys, "argv", ["teach_shapes.py", flag, value])
    monkeypatch.setattr(teach_shapes, "teach", lambda *a: pytest.fail("teach ran"))
    with pytest.raises(SystemExit) as exited:
        teach_shapes.main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_teach_shapes_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["teach_shapes.py", "--help"])
    with pytest.raises(SystemExit):
        teach_shapes.main()
    text = " ".join(capsys.readouterr().out.split())
    for option, default in (("--tower-steps", "3000"), ("--tower-pictures", "24000"),
                            ("--words-steps", "3000"), ("--words-pictures", "6000"),
                            ("--text-layers", "2"), ("--seed", "0")):
        # the option, its metavar, its help (no "--" in it), then its own default
        assert re.search(rf"{option} \S+ [^-]*\(default: {default}\)", text), option
