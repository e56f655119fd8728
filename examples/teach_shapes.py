"""Build a tiny vision-language model and teach it to describe pictures of shapes, offline.

    python examples/teach_shapes.py      # about 25 minutes on 2 CPU cores
    python examples/teach_shapes.py --continue-from examples/shapes-vlm \\
        --words-steps 800 --words-learning-rate 3e-4   # 5 minutes: stage 2 only

1. builds a random Qwen2-VL (examples/tiny_vlm.py): a vision tower 64 wide and 2 blocks
   deep on 8-pixel patches, a language model 64 wide and 2 layers deep, and a tokenizer
   that knows the words it will need;
2. stage 1 (examples/shape_tower.py): teaches the vision tower alone to tell the shape,
   colour and background of 24,000 pictures -- one circle, square or triangle in red,
   green, blue or yellow on white, black or gray, drawn at any size and aspect ratio
   with the shape anywhere (``shapes.draw_varied``) -- read at 112 x 112 pixels' worth;
3. stage 2 (examples/shape_words.py): sets the image processor to 144 x 144 pixels'
   worth (more tokens per picture than stage 1 saw, which the tower reads better) and
   teaches the language model, the tower frozen, to answer "What is in the picture?"
   ("a red circle on a white background") in 6,000 conversations: 40% about one
   picture, the others two or three turns long, each turn bringing a new picture or
   asking again, every answer about the newest picture;
4. stores it in float16 with ``python -m mlxvlm.convert``, with a greedy
   ``generation_config.json``, and measures it with examples/evaluate_shapes.py on
   fresh pictures from drawing code of their own, alone and in two-turn chats;
5. writes it to ``--output`` (a new folder, ``examples/shapes-vlm-retrained`` by
   default: the published model, ``examples/shapes-vlm``, is replaced only on purpose,
   with ``--output examples/shapes-vlm --overwrite``) with a model card saying how it
   was taught and measured, and draws the example pictures of ``examples/images`` where
   they are missing.

``--continue-from MODEL`` skips 1 and 2 (building, stage 1): MODEL's tower stays as it is
and its language model goes on learning in stage 2; the card keeps MODEL's own account
of how it was taught and adds this one.

Then:

    python -m mlxvlm.generate --model examples/shapes-vlm-retrained \\
        --image examples/images/red-circle.png --prompt "What is in the picture?"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import evaluate_shapes  # noqa: E402
import shape_tower  # noqa: E402
import shape_words  # noqa: E402
import shapes  # noqa: E402
import tiny_vlm  # noqa: E402

TOWER_PIXELS = 112 * 112  # stage 1's budget per picture: 49 merged tokens if square
READ_PIXELS = 144 * 144  # the published processor's: 81 merged tokens if square
PATCH = 8
EXAMPLE_SIZE = 112
PICTURES = {  # file name -> (colour, shape, background)
    "red-circle.png": ("red", "circle", "white"),
    "blue-triangle.png": ("blue", "triangle", "black"),
    "yellow-square.png": ("yellow", "square", "gray"),
}
EVALUATION = dict(count=200, seed=1234)
PASS_MARK = 0.9

CARD = """---
library_name: mlx
pipeline_tag: image-text-to-text
tags: [mlx, mlxvlm]
---

# shapes-vlm

A {parameters:.2f} M-parameter Qwen2-VL made offline by `examples/teach_shapes.py`. It
knows one question, "What is in the picture?", and one kind of picture: a circle, square
or triangle in red, green, blue or yellow on a white, black or gray background. It
answers "a red circle on a white background", and knows nothing else. In a chat it
answers about the newest picture: a later turn that brings a new picture is answered
about that one, and a turn that asks again without a picture about the latest.

```bash
python -m mlxvlm.generate --model examples/shapes-vlm \\
    --image examples/images/red-circle.png --prompt "What is in the picture?"
```

## How it was taught

{taught}

## How well it does

{score:.1%} of {count} fresh pictures described exactly right (colour {colour:.1%}, shape
{shape:.1%}, background {background:.1%}), measured by
`python examples/evaluate_shapes.py -n {count} --seed {seed}`. In chats of two turns,
each bringing a fresh picture unlike the one before and the model's first answer kept
in the history: {chat_score:.1%} of {chat_count} second pictures described exactly
right ({chat_earlier:.1%} described the first picture instead), measured by
`python examples/evaluate_shapes.py -n {chat_count} --seed {seed} --turns 2`; with each
question before its picture, as OpenAI clients often send it, {text_first_score:.1%}
(`--text-first`); asked again in a third turn without a picture, {again_score:.1%}
(`--turns 2 --ask-again`).
Those pictures come from drawing code of their own, not the training code: 64-448 px a
side, the shape 35-85% of the shorter side and anywhere in the picture, circles as
ellipses or many-sided polygons (some stretched to 1.5:1), squares as rectangles (some
1.5:1), triangles upright, upside down or equilateral, the colour jittered up to 35 per
channel around the palette and the background up to 12, some outlined, some
anti-aliased.
"""

CONVERSATIONS = ("{words_conversations:,} conversations: {single:.0%} ask about one picture, "
                 "the others go on for two or three turns, each bringing a new picture or "
                 "asking again, and every answer is about the newest picture")

TAUGHT = """From random weights, in two stages: the vision tower alone ({tower_steps:,} steps on
{tower_pictures:,} pictures, naming shape, colour and background through a readout that
is then dropped), then the language model with the tower frozen ({words_steps:,} steps on
""" + CONVERSATIONS + """). The pictures are drawn by
`examples/shapes.py`: 48-480 px a side, any aspect ratio, the shape 22-94% of the
shorter side and anywhere, ellipses and rectangles up to 1.7:1, triangles of six
kinds, colours and backgrounds jittered, some outlined or anti-aliased. The image
processor resizes every picture to about 144 x 144 pixels' worth, keeping its aspect
ratio. Weights in float16; `generation_config.json` makes it greedy.

Training took {minutes:.0f} minutes on {machine}."""

CONTINUED = """{previous}

Then `examples/teach_shapes.py --continue-from {source}` went on teaching its language
model, the tower frozen: {words_steps:,} more steps (peak learning rate
{words_learning_rate:g}) on """ + CONVERSATIONS + """. That took {minutes:.0f} minutes on
{machine}."""


def taught_before(model: Path) -> str:
    """How ``model`` was taught, as its own card tells it."""
    card = model / "README.md"
    text = card.read_text() if card.is_file() else ""
    marker = "## How it was taught\n"
    if marker not in text:
        return f"Taught as `{model}` was (it has no card saying how)."
    return text.split(marker, 1)[1].split("\n## ", 1)[0].strip()


def card(facts: dict, result: dict, chat: dict, text_first: dict, again: dict) -> str:
    """The model card: what it knows, how it was taught (``facts``) and how it did
    (``evaluate_shapes.evaluate``'s ``result`` alone, in a ``chat``, the same with each
    question first, asked ``again``)."""
    facts = dict(facts, single=dict(shape_words.TURNS)[(True,)])
    taught = (CONTINUED if facts.get("source") else TAUGHT).format(**facts)
    # the paragraphs filled again: the facts put in have lengths of their own
    taught = "\n\n".join(textwrap.fill(" ".join(paragraph.split()), 88, break_on_hyphens=False,
                                        break_long_words=False)
                          for paragraph in taught.split("\n\n"))
    return CARD.format(**facts, **result, taught=taught, chat_score=chat["score"],
                       chat_count=chat["count"], chat_earlier=chat["earlier"],
                       text_first_score=text_first["score"], again_score=again["score"])


def run(*args: str) -> None:
    print("$ python -m", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", *args], check=True)


def machine() -> str:
    """The CPU's name and how many cores this process may use."""
    name = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if sys.platform == "darwin":
        done = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                              capture_output=True, text=True)
        name = done.stdout.strip() or name
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores of an {name}" if name[:1].upper() in "AEIOU" else f"{cores} cores of a {name}"


def write_generation_config(directory: Path) -> None:
    """Greedy decoding, as transformers writes it, with the checkpoint's special ids."""
    from transformers import GenerationConfig

    config = json.loads((directory / "config.json").read_text())["text_config"]
    GenerationConfig(do_sample=False, bos_token_id=config["bos_token_id"],
                     eos_token_id=config["eos_token_id"],
                     pad_token_id=config["pad_token_id"]).save_pretrained(directory)


def teach(work: Path, args) -> tuple[Path, dict]:
    """Build (or take ``args.continue_from``), teach and convert the model in ``work``;
    returns it and the card's facts."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxvlm import load
    from mlxvlm.convert import write_weights

    tic = time.perf_counter()
    base = work / "base"
    facts = dict(words_steps=args.words_steps, words_conversations=args.words_conversations,
                 words_learning_rate=args.words_learning_rate)
    if args.continue_from:
        source = Path(args.continue_from)
        shutil.copytree(source, base, ignore=shutil.ignore_patterns("README.md"))
        facts.update(source=str(args.continue_from), previous=taught_before(source))
    else:
        backgrounds = tuple(shapes.BACKGROUNDS)
        corpus = [shapes.describe(*c) for c in shapes.classes(backgrounds)] * 4
        tiny_vlm.build_checkpoint(
            base, corpus + [shapes.QUESTION] * 4, seed=args.seed, pixels=TOWER_PIXELS,
            patch_size=PATCH, vision_width=64, vision_depth=2, num_layers=args.text_layers)

        model, processor = load(base)
        print(f"stage 1: the vision tower, {args.tower_steps} steps", flush=True)
        readout = shape_tower.train_tower(model, processor, steps=args.tower_steps,
                                          pictures=args.tower_pictures, seed=args.seed)
        seen = shape_tower.readout_accuracy(model.vision_tower, readout, processor, 300, 1234)
        print(f"the tower's readout names the shape of {seen:.1%} of 300 fresh pictures",
              flush=True)
        write_weights(model, base)
        tiny_vlm.write_image_processor(base, READ_PIXELS, PATCH)
        facts.update(tower_steps=args.tower_steps, tower_pictures=args.tower_pictures)

    # float32 whatever the checkpoint's dtype: a float16 one (a published model) would
    # learn in float16 otherwise
    model, processor = load(base, dtype=mx.float32)
    parameters = sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6
    print(f"stage 2: the language model, {args.words_steps} steps", flush=True)
    shape_words.train_words(model, processor, steps=args.words_steps,
                            conversations_count=args.words_conversations,
                            learning_rate=args.words_learning_rate, seed=args.seed + 1)
    write_weights(model, base)
    minutes = (time.perf_counter() - tic) / 60

    final = work / "shapes-vlm"
    run("mlxvlm.convert", "--hf-path", str(base), "--mlx-path", str(final), "--dtype", "float16")
    write_generation_config(final)
    facts.update(parameters=parameters, minutes=minutes, machine=machine())
    return final, facts


def measure(model: Path) -> tuple[dict, ...]:
    """``evaluate_shapes``' figures for the card: fresh pictures alone, the second of a
    two-turn chat, the same with each question before its picture, and asked again
    without a picture."""
    return (evaluate_shapes.evaluate(model, **EVALUATION),
            evaluate_shapes.evaluate(model, **EVALUATION, turns=2),
            evaluate_shapes.evaluate(model, **EVALUATION, turns=2, text_first=True),
            evaluate_shapes.evaluate(model, **EVALUATION, turns=2, ask_again=True))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--output", default=str(HERE / "shapes-vlm-retrained"),
                        help="Where the model goes")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace --output if it exists")
    parser.add_argument("--tower-steps", type=int, default=3000, help="Stage 1's training steps")
    parser.add_argument("--tower-pictures", type=int, default=24000,
                        help="Pictures drawn for stage 1")
    parser.add_argument("--words-steps", type=int, default=3000, help="Stage 2's training steps")
    parser.add_argument("--words-conversations", type=int, default=6000,
                        help="Conversations drawn for stage 2")
    parser.add_argument("--words-learning-rate", type=float, default=1e-3,
                        help="Stage 2's peak learning rate")
    parser.add_argument("--continue-from", metavar="MODEL",
                        help="Go on teaching this model's language model (stage 2 only) "
                             "instead of building a new one")
    parser.add_argument("--text-layers", type=int, default=2, help="Language model layers")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the weights and pictures")
    args = parser.parse_args()
    for name in ("tower_steps", "words_steps"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be at least 2")
    for name in ("tower_pictures", "words_conversations", "text_layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.words_learning_rate > 0:
        parser.error("--words-learning-rate must be above 0")
    output = Path(args.output)
    if output.exists() and not args.overwrite:
        parser.error(f"{output} exists: pass --overwrite to replace it, or another --output")
    if args.continue_from and not (Path(args.continue_from) / "config.json").is_file():
        parser.error(f"--continue-from {args.continue_from}: no model there (no config.json)")

    with tempfile.TemporaryDirectory() as work:
        final, facts = teach(Path(work), args)
        results = measure(final)
        for result in results:
            print(evaluate_shapes.summary(result))
        if min(result["score"] for result in results) < PASS_MARK:
            print("not good enough to publish; try more steps or another --seed")
            return 1
        shutil.rmtree(output, ignore_errors=True)
        shutil.copytree(final, output)
        (output / "README.md").write_text(card(facts, *results))

    print(f"saved the model to {output}")
    save_missing_pictures(HERE / "images")
    return 0


def save_missing_pictures(folder: Path) -> None:
    """The example pictures the card and README name, drawn where they are missing (the
    same pictures whatever the model's seed: the committed ones)."""
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(3)
    for name, label in PICTURES.items():
        picture = shapes.draw(*label, size=EXAMPLE_SIZE, rng=rng)
        if not (folder / name).exists():
            picture.save(folder / name)
            print(f"saved {folder / name}")


if __name__ == "__main__":
    raise SystemExit(main())
