"""Build a tiny vision-language model and teach it to describe pictures of shapes, offline.

    python examples/teach_shapes.py      # about 15 minutes on 2 CPU cores

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
   about 6,000 more ("a red circle on a white background");
4. stores it in float16 with ``python -m mlxvlm.convert``, with a greedy
   ``generation_config.json``, and measures it with examples/evaluate_shapes.py on
   fresh pictures from drawing code of their own;
5. copies it into ``examples/shapes-vlm`` with a model card saying what it was measured
   on, and saves a few example pictures into ``examples/images``.

Then:

    python -m mlxvlm.generate --model examples/shapes-vlm \\
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
answers "a red circle on a white background", and knows nothing else.

```bash
python -m mlxvlm.generate --model examples/shapes-vlm \\
    --image examples/images/red-circle.png --prompt "What is in the picture?"
```

## How it was taught

From random weights, in two stages: the vision tower alone ({tower_steps:,} steps on
{tower_pictures:,} pictures, naming shape, colour and background through a readout that
is then dropped), then the language model with the tower frozen ({words_steps:,} steps on
{words_pictures:,} pictures with the question and answer). The pictures are drawn by
`examples/shapes.py`: 48-480 px a side, any aspect ratio, the shape 22-94% of the
shorter side and anywhere, ellipses and rectangles up to 1.7:1, triangles of six
kinds, colours and backgrounds jittered, some outlined or anti-aliased. The image
processor resizes every picture to about 144 x 144 pixels' worth, keeping its aspect
ratio. Weights in float16; `generation_config.json` makes it greedy.

Training took {minutes:.0f} minutes on {machine}.

## How well it does

{score:.1%} of {count} fresh pictures described exactly right (colour {colour:.1%}, shape
{shape:.1%}, background {background:.1%}), measured by
`python examples/evaluate_shapes.py -n {count} --seed {seed}`. Those pictures come from
drawing code of their own, not the training code: 64-448 px a side, the shape 35-85% of
the shorter side and anywhere in the picture, circles as ellipses or many-sided polygons
(some stretched to 1.5:1), squares as rectangles (some 1.5:1), triangles upright,
upside down or equilateral, the colour jittered up to 35 per channel around the palette
and the background up to 12, some outlined, some anti-aliased.
"""


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
    """Build, teach and convert the model in ``work``; returns it and the card's facts."""
    from mlx.utils import tree_flatten

    from mlxvlm import load
    from mlxvlm.convert import write_weights

    tic = time.perf_counter()
    backgrounds = tuple(shapes.BACKGROUNDS)
    corpus = [shapes.describe(*c) for c in shapes.classes(backgrounds)] * 4
    base = tiny_vlm.build_checkpoint(
        work / "base", corpus + [shapes.QUESTION] * 4, seed=args.seed, pixels=TOWER_PIXELS,
        patch_size=PATCH, vision_width=64, vision_depth=2, num_layers=args.text_layers)

    model, processor = load(base)
    print(f"stage 1: the vision tower, {args.tower_steps} steps", flush=True)
    readout = shape_tower.train_tower(model, processor, steps=args.tower_steps,
                                      pictures=args.tower_pictures, seed=args.seed)
    seen = shape_tower.readout_accuracy(model.vision_tower, readout, processor, 300, 1234)
    print(f"the tower's readout names the shape of {seen:.1%} of 300 fresh pictures", flush=True)
    write_weights(model, base)
    tiny_vlm.write_image_processor(base, READ_PIXELS, PATCH)

    model, processor = load(base)
    parameters = sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6
    print(f"stage 2: the language model, {args.words_steps} steps", flush=True)
    shape_words.train_words(model, processor, steps=args.words_steps,
                            pictures=args.words_pictures, seed=args.seed + 1)
    write_weights(model, base)
    minutes = (time.perf_counter() - tic) / 60

    final = work / "shapes-vlm"
    run("mlxvlm.convert", "--hf-path", str(base), "--mlx-path", str(final), "--dtype", "float16")
    write_generation_config(final)
    facts = dict(parameters=parameters, minutes=minutes, machine=machine(),
                 tower_steps=args.tower_steps, tower_pictures=args.tower_pictures,
                 words_steps=args.words_steps, words_pictures=args.words_pictures)
    return final, facts


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--output", default=str(HERE / "shapes-vlm"), help="Where the model goes")
    parser.add_argument("--tower-steps", type=int, default=3000, help="Stage 1's training steps")
    parser.add_argument("--tower-pictures", type=int, default=24000,
                        help="Pictures drawn for stage 1")
    parser.add_argument("--words-steps", type=int, default=3000, help="Stage 2's training steps")
    parser.add_argument("--words-pictures", type=int, default=6000,
                        help="Pictures drawn for stage 2")
    parser.add_argument("--text-layers", type=int, default=2, help="Language model layers")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the weights and pictures")
    args = parser.parse_args()
    for name in ("tower_steps", "words_steps"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be at least 2")
    for name in ("tower_pictures", "words_pictures", "text_layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    with tempfile.TemporaryDirectory() as work:
        final, facts = teach(Path(work), args)
        result = evaluate_shapes.evaluate(final, **EVALUATION)
        print(f"fresh pictures described exactly right: {result['score']:.1%} "
              f"of {result['count']} (colour {result['colour']:.1%}, shape "
              f"{result['shape']:.1%}, background {result['background']:.1%})")
        if result["score"] < PASS_MARK:
            print("not good enough to publish; try more steps or another --seed")
            return 1
        output = Path(args.output)
        shutil.rmtree(output, ignore_errors=True)
        shutil.copytree(final, output)
        (output / "README.md").write_text(CARD.format(**facts, **result))

    (HERE / "images").mkdir(exist_ok=True)
    rng = np.random.default_rng(args.seed + 3)
    for name, label in PICTURES.items():
        shapes.draw(*label, size=EXAMPLE_SIZE, rng=rng).save(HERE / "images" / name)
    print(f"saved the model to {output} and example pictures to {HERE / 'images'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
