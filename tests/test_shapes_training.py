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
    """Conversations of one to three turns and pictures, padded into one (B, L) batch
    with each row's own M-RoPE positions: the mean loss per answer token of
    mlxvlm.finetune's one-sequence-at-a-time loss over them."""
    model, processor = tiny
    encoded = list(shape_words.conversations(processor, 12, seed=4))
    pictures = [int(np.asarray(e.features["image_grid_thw"]).shape[0]) for e in encoded]
    answers = [len(np.flatnonzero(np.diff(e.loss_mask.astype(int)) == 1)) for e in encoded]
    assert 1 in pictures and max(pictures) > 1  # single pictures and later ones
    assert any(a > p for a, p in zip(answers, pictures))  # a turn asking again
    rows = shape_words.encode_rows(model, encoded, log=lambda _: None)
    assert len({len(r.ids) for r in rows}) > 1  # the batch needs padding
    for members in (range(12), [0], [5, 2, 9]):
        batch = shape_words.make_batch([rows[m] for m in members])
        batched = shape_words.batch_loss(model.language_model, batch).item()
        total = answer_tokens = 0.0
        for member in members:
            input_ids, loss_mask, features = model_inputs(model, encoded[member])
            total += sequence_loss(model, input_ids, loss_mask, features).item()
            answer_tokens += loss_mask[1:].sum().item()
        assert batched == pytest.approx(total / answer_tokens, rel=1e-5), list(members)


def test_later_turns_are_answered_about_the_newest_picture():
    """Stage 2's conversations, every kind of them: each answer describes the newest
    picture drawn so far."""
    rng = np.random.default_rng(0)
    labels = shapes.classes(tuple(shapes.BACKGROUNDS))
    drawn = []

    def draw(*label, rng):
        drawn.append(label)
        return shapes.draw(*label, size=32, rng=rng)

    seen = set()
    for _ in range(80):
        drawn.clear()
        messages, images = shape_words.draw_conversation(rng, labels, draw)
        asked = [m for m in messages if m["role"] == "user"]
        pictured = tuple(m["content"] != shapes.QUESTION for m in asked)
        seen.add(pictured)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(answers) == len(pictured) and len(images) == len(drawn) == sum(pictured)
        newest = [drawn[k] for k in np.cumsum(pictured) - 1]
        assert answers == [shapes.describe(*label) for label in newest]
    assert seen == {kind for kind, _ in shape_words.TURNS}


# Run in a fresh process (and its spawned picture workers) where torch is absent, as in
# a plain ``pip install -e .``: sitecustomize marks torch and its companions missing, so
# ``import torch`` fails and ``find_spec`` says "not installed", as without the package.
NO_TORCH = "import sys\nfor name in ('torch', 'torchvision', 'torchaudio'):\n    sys.modules[name] = None\n"

RECIPE = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, EXAMPLES)
import numpy as np
import shapes, teach_shapes
from mlx.utils import tree_flatten
from mlxvlm import generate, load

args = SimpleNamespace(seed=1, text_layers=1, tower_steps=3, tower_pictures=32,
                       words_steps=3, words_conversations=16, words_learning_rate=1e-3,
                       continue_from=None)
final, facts = teach_shapes.teach(Path(WORK) / "new", args)
model, processor = load(final)
result = generate(model, processor, shapes.QUESTION, image=shapes.draw("red", "circle"),
                  max_tokens=3)
measured = dict(score=0.5, colour=1, shape=0.5, background=1, count=10, seed=2)
chat = dict(measured, score=0.25, earlier=0.75)
card = teach_shapes.card(facts, measured, chat, dict(chat, score=0.375), dict(chat, score=0.125))
(final / "README.md").write_text(card)

args.continue_from, args.words_steps, args.words_learning_rate = str(final), 2, 3e-4
more, more_facts = teach_shapes.teach(Path(WORK) / "more", args)
more_card = teach_shapes.card(more_facts, measured, chat, chat, chat)
again, _ = load(more)
def weights(m, part):
    return {k: np.array(v) for k, v in tree_flatten(getattr(m, part).parameters())}
tower_kept = all(np.array_equal(a, weights(again, "vision_tower")[k])
                 for k, a in weights(model, "vision_tower").items())
words_moved = any(not np.array_equal(a, weights(again, "language_model")[k])
                  for k, a in weights(model, "language_model").items())
print("RESULT " + json.dumps(dict(
    generation_config=json.loads((final / "generation_config.json").read_text()),
    config=json.loads((final / "config.json").read_text()),
    generation_tokens=result.generation_tokens, facts=facts, card=card,
    more_facts=more_facts, more_card=more_card, tower_kept=tower_kept,
    words_moved=words_moved,
    torch_loaded="torch" in sys.modules and sys.modules["torch"] is not None)))
"""


def test_the_recipe_runs_to_a_greedy_checkpoint_without_torch(tmp_path):
    """The whole recipe on a few pictures, then ``--continue-from`` its model: the tower
    kept, the language model taught further, the card telling both."""
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
    card = " ".join(out["card"].split())
    assert "cores of" in card and "10 fresh pictures" in card
    assert "3 steps on 16 conversations: 40% ask about one picture" in card
    assert "25.0% of 10 second pictures" in card and "(75.0% described the first" in card
    assert "as OpenAI clients often send it, 37.5%" in card
    assert "again in a third turn without a picture, 12.5%" in card
    assert "tower_steps" not in out["more_facts"]
    more = " ".join(out["more_card"].split())
    taught = card.split("## How it was taught ")[1].split(" ## ")[0]
    assert taught in more  # the first model's account, kept whole
    assert "--continue-from " + out["more_facts"]["source"] in more
    assert "2 more steps (peak learning rate 0.0003) on 16 conversations" in more
    assert out["tower_kept"] and out["words_moved"]
    assert out["torch_loaded"] is False


@pytest.mark.parametrize("flag, value, message", [
    ("--tower-steps", "1", "--tower-steps must be at least 2"),
    ("--words-steps", "0", "--words-steps must be at least 2"),
    ("--tower-pictures", "0", "--tower-pictures must be at least 1"),
    ("--words-conversations", "-3", "--words-conversations must be at least 1"),
    ("--text-layers", "0", "--text-layers must be at least 1"),
    ("--words-learning-rate", "0", "--words-learning-rate must be above 0"),
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
                            ("--words-steps", "3000"), ("--words-conversations", "6000"),
                            ("--words-learning-rate", "0.001"),
                            ("--text-layers", "2"), ("--seed", "0")):
        # the option, its metavar, its help (no "--" in it), then its own default
        assert re.search(rf"{option} \S+ [^-]*\(default: {default}\)", text), option


class Taught(Exception):
    """teach was reached: the options passed every check."""


def run_main(monkeypatch, *argv: str):
    monkeypatch.setattr(sys, "argv", ["teach_shapes.py", *argv])
    monkeypatch.setattr(teach_shapes, "teach", lambda *a: (_ for _ in ()).throw(Taught()))
    return teach_shapes.main()


def test_teach_shapes_leaves_the_published_model_alone(monkeypatch, capsys, tmp_path):
    """By default the model goes to a new folder; an existing one (the published model
    included) is replaced only with --overwrite, and that is refused before any work."""
    with pytest.raises(Taught):  # a new folder: on to teaching
        run_main(monkeypatch, "--output", str(tmp_path / "new"))
    for existing in (EXAMPLES / "shapes-vlm", tmp_path):
        with pytest.raises(SystemExit) as exited:
            run_main(monkeypatch, "--output", str(existing))
        assert exited.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
            f"{existing} exists: pass --overwrite to replace it, or another --output")
        with pytest.raises(Taught):
            run_main(monkeypatch, "--output", str(existing), "--overwrite")
    assert (EXAMPLES / "shapes-vlm" / "config.json").is_file()
    monkeypatch.setattr(sys, "argv", ["teach_shapes.py", "--help"])
    with pytest.raises(SystemExit):
        teach_shapes.main()
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps long paths
    assert f"--outputOUTPUTWherethemodelgoes(default:{EXAMPLES / 'shapes-vlm-retrained'})" in help_text


def test_teach_shapes_continues_only_from_a_model(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        run_main(monkeypatch, "--continue-from", str(tmp_path), "--output", str(tmp_path / "new"))
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"--continue-from {tmp_path}: no model there (no config.json)")
    with pytest.raises(Taught):
        run_main(monkeypatch, "--continue-from", str(EXAMPLES / "shapes-vlm"),
                 "--output", str(tmp_path / "new"))


def test_missing_example_pictures_are_drawn_and_present_ones_kept(tmp_path):
    """The committed pictures are the ones drawn, whatever the model's seed; a picture
    already there is not redrawn."""
    kept = tmp_path / "red-circle.png"
    kept.write_bytes(b"not redrawn")
    teach_shapes.save_missing_pictures(tmp_path)
    assert kept.read_bytes() == b"not redrawn"
    for name in teach_shapes.PICTURES:
        if name != kept.name:
            assert (tmp_path / name).read_bytes() == (EXAMPLES / "images" / name).read_bytes()
