"""It learns from images: a tiny random VLM, LoRA-fine-tuned for a bounded number of steps
on CPU on synthetic pictures (a coloured shape on a white background; the answer names
colour and shape, 12 classes), tells held-out pictures apart; untrained it is at chance,
and with the pictures shuffled against the questions its accuracy collapses.

Accuracy is measured two ways: which of the 12 possible answers the model finds most
likely (so chance is 1/12), and the model's own greedy answer through ``mlxvlm.generate``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from finetune_helpers import EXAMPLES  # noqa: F401  (puts examples/ on the path)
import shapes
import tiny_vlm
from mlxvlm import generate, load
from mlxvlm.finetune import FinetuneConfig, finetune
from mlxvlm.finetune.masking import encode_conversation
from mlxvlm.finetune.trainer import model_inputs, sequence_loss

SIZE = 112  # 16 image tokens
CLASSES = shapes.classes()  # (colour, shape, "white")
CHANCE = 1 / len(CLASSES)
# The recipe (measured on 2 CPU cores: ~40 s of training, 97.2-100% ranked and 12/12
# greedy over checkpoint seeds 0-2).
RECIPE = dict(method="lora", rank=16, alpha=32, batch_size=8, iters=250, learning_rate=2e-3,
              lr_schedule="cosine", warmup_steps=10, seed=0, save_every=1000)


def held_out(per_class: int, seed: int):
    rng = np.random.default_rng(seed)
    labels = [i % len(CLASSES) for i in range(per_class * len(CLASSES))]
    return [shapes.draw(*CLASSES[k], size=SIZE, rng=rng) for k in labels], labels


def ranked_accuracy(model, processor, images, labels) -> float:
    """How often the most likely of the 12 answers is the right one."""
    hits = 0
    for image, label in zip(images, labels):
        losses = [
            sequence_loss(model, *model_inputs(model, encode_conversation(
                processor, shapes.conversation(shapes.describe(*c)), [image]))).item()
            for c in CLASSES
        ]
        hits += int(np.argmin(losses)) == label
    return hits / len(labels)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    corpus = [shapes.describe(*c) for c in shapes.classes(tuple(shapes.BACKGROUNDS))] * 4
    checkpoint = tiny_vlm.build_checkpoint(root / "model", corpus + [shapes.QUESTION] * 4,
                                           seed=0, image_size=SIZE)
    data = shapes.write_dataset(root / "data" / "train.jsonl", 20 * len(CLASSES), seed=0, size=SIZE)
    tic = time.perf_counter()
    result = finetune(FinetuneConfig(model=str(checkpoint), data=str(data),
                                     output=str(root / "adapter"), **RECIPE))
    seconds = time.perf_counter() - tic
    return checkpoint, result, seconds


def test_a_fine_tuned_model_reads_colour_and_shape_from_the_image(setup):
    checkpoint, result, seconds = setup
    images, labels = held_out(per_class=3, seed=99)

    untrained, processor = load(checkpoint)
    before = ranked_accuracy(untrained, processor, images, labels)

    model, processor = load(checkpoint, adapter_path=result.output)
    after = ranked_accuracy(model, processor, images, labels)
    derangement = np.random.default_rng(7).permutation(len(images))
    shuffled = ranked_accuracy(model, processor, [images[i] for i in derangement], labels)

    print(f"\n{result.steps} steps in {seconds:.0f}s (final train loss {result.train_loss:.3f}); "
          f"held-out accuracy: untrained {before:.3f}, trained {after:.3f}, "
          f"images shuffled {shuffled:.3f} (chance {CHANCE:.3f})")
    assert before <= 0.25
    assert after >= 0.9
    assert shuffled <= 0.25


def test_its_greedy_answers_describe_the_pictures(setup):
    checkpoint, result, _ = setup
    model, processor = load(checkpoint, adapter_path=result.output)
    images, labels = held_out(per_class=1, seed=123)
    answers = [generate(model, processor, shapes.QUESTION, image=image, max_tokens=16).text.strip()
               for image in images]
    expected = [shapes.describe(*CLASSES[k]) for k in labels]
    right = sum(a == e for a, e in zip(answers, expected))
    print(f"\ngreedy answers right: {right}/{len(expected)}, e.g. {answers[0]!r}")
    assert right >= 0.9 * len(expected), list(zip(answers, expected))
