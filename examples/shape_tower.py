"""Stage 1 of teaching the shapes demo: the vision tower learns to see shapes.

A randomly initialised tower's tokens carry a picture's colours but hardly its outline,
and a language model taught on them learns colours and guesses shapes. So the tower is
taught first, on its own: a small readout looks at its merged tokens -- the ones the
language model will read -- and names the shape, the colour and the background. The
readout takes each feature's largest value over the picture's tokens, so the tower
learns to mark what it sees strongly in some token, where the language model's
attention can find it. (A readout by softmax attention, the way the language model
reads, learns far more slowly from a random tower.) The readout is thrown away
afterwards; the tower's weights stay.

Pictures come from ``shapes.draw_varied`` (any size and aspect ratio, the shape
anywhere), drawn beforehand in worker processes and shrunk to the image processor's
budget, so that a training step costs only the processor's patching and the tower.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shapes  # noqa: E402

import mlxvlm  # noqa: E402,F401  (sets up MLX's CPU backend before mlx.core loads)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402

QUESTIONS = (  # what the readout names, and in which order its logits come
    ("shape", shapes.SHAPES),
    ("colour", tuple(shapes.COLORS)),
    ("background", tuple(shapes.BACKGROUNDS)),
)


def _draw_chunk(seed: int, count: int, pixels: int, factor: int):
    """``count`` varied pictures, each resized as the image processor would to
    ``pixels`` pixels (sides multiples of ``factor``), with their label indices."""
    from PIL import Image
    # The PIL processor's module: the other one imports torch.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rng = np.random.default_rng(seed)
    labels = shapes.classes(tuple(shapes.BACKGROUNDS))
    drawn = []
    for _ in range(count):
        label = labels[int(rng.integers(len(labels)))]
        image = shapes.draw_varied(*label, rng=rng)
        height, width = smart_resize(image.height, image.width, factor=factor,
                                     min_pixels=pixels, max_pixels=pixels)
        image = image.resize((width, height), Image.BICUBIC)
        index = tuple(names.index(value) for (_, names), value in
                      zip(QUESTIONS, (label[1], label[0], label[2])))
        drawn.append((np.asarray(image), index))
    return drawn


def draw_pool(count: int, seed: int, pixels: int, factor: int, workers: int = 2,
              chunk: int = 500) -> list:
    """``count`` training pictures as uint8 arrays with their labels, drawn in chunks
    by ``workers`` processes (the same pictures whatever the number of workers). The
    workers are spawned, not forked, on every platform: this process already runs MLX's
    and the BLAS's threads, which a fork would copy mid-flight."""
    chunks = [(seed * 100_003 + k, min(chunk, count - start), pixels, factor)
              for k, start in enumerate(range(0, count, chunk))]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = pool.map(_draw_chunk, *zip(*chunks))
        return [item for part in parts for item in part]


class Readout(nn.Module):
    """Per question, a linear map of the largest value of each feature over one
    picture's RMS-normalised merged tokens."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.answers = [nn.Linear(width, len(names)) for _, names in QUESTIONS]

    def __call__(self, tokens: mx.array, picture_of_token: mx.array, pictures: int):
        x = self.norm(tokens)  # (N, D)
        mine = picture_of_token[None, :] == mx.arange(pictures)[:, None]  # (B, N)
        pooled = mx.max(mx.where(mine[:, :, None], x[None], -1e9), axis=1)  # (B, D)
        return [answer(pooled) for answer in self.answers]


def warmup_then_cosine(learning_rate: float, steps: int):
    """Both stages' schedule: a linear warm-up over the first 50 steps (fewer in a short
    run), then a cosine decay to a fiftieth of ``learning_rate``."""
    warmup = max(1, min(50, steps // 10))
    return optim.join_schedules(
        [optim.linear_schedule(learning_rate / warmup, learning_rate, warmup),
         optim.cosine_decay(learning_rate, steps - warmup, learning_rate / 50)], [warmup])


def tower_loss(tower, readout, processor, batch):
    """The summed cross-entropy of the three questions over ``batch``, and the share of
    shapes named right."""
    images = [picture for picture, _ in batch]
    inputs = processor.image_processor(images=images, return_tensors="np")
    grids = np.asarray(inputs["image_grid_thw"])
    tokens = tower(mx.array(inputs["pixel_values"]), grids)
    merged = grids.prod(axis=1) // tower.config.spatial_merge_size**2
    picture_of_token = mx.array(np.repeat(np.arange(len(batch)), merged))
    logits = readout(tokens, picture_of_token, len(batch))
    labels = mx.array([index for _, index in batch])
    loss = sum(nn.losses.cross_entropy(lg, labels[:, q], reduction="mean")
               for q, lg in enumerate(logits))
    return loss, mx.mean(mx.argmax(logits[0], axis=-1) == labels[:, 0])


def train_tower(model, processor, *, steps: int, pictures: int, batch_size: int = 16,
                learning_rate: float = 2e-3, seed: int = 0, log=print) -> Readout:
    """Teach ``model``'s vision tower (in place) on ``pictures`` varied pictures for
    ``steps`` steps of Adam (``warmup_then_cosine``); returns the readout."""
    tower = model.vision_tower
    budget = processor.image_processor.size["longest_edge"]
    factor = tower.config.patch_size * tower.config.spatial_merge_size
    workers = min(2, os.cpu_count() or 1)
    log(f"drawing {pictures} training pictures in {workers} processes")
    tic = time.perf_counter()
    pool = draw_pool(pictures, seed, budget, factor, workers)
    log(f"drew {len(pool)} pictures in {time.perf_counter() - tic:.0f} s")

    mx.random.seed(seed)
    readout = Readout(tower.config.out_hidden_size)
    both = nn.Module()
    both.tower, both.readout = tower, readout
    optimizer = optim.Adam(learning_rate=warmup_then_cosine(learning_rate, steps))

    def loss_fn(module, batch):
        return tower_loss(module.tower, module.readout, processor, batch)

    step_fn = nn.value_and_grad(both, loss_fn)
    rng = np.random.default_rng(seed + 1)
    recent = []
    tic = time.perf_counter()
    for step in range(1, steps + 1):
        batch = [pool[i] for i in rng.integers(len(pool), size=batch_size)]
        (loss, right), grads = step_fn(both, batch)
        optimizer.update(both, grads)
        mx.eval(both.parameters(), optimizer.state, loss, right)
        recent = (recent + [right.item()])[-100:]
        if step % 100 == 0 or step == steps:
            log(f"tower step {step}/{steps}: loss {loss.item():.3f}, shapes right "
                f"{np.mean(recent):.1%} (last 100 steps), {time.perf_counter() - tic:.0f} s")
    return readout


def readout_accuracy(tower, readout, processor, count: int, seed: int) -> float:
    """The share of ``count`` fresh pictures (examples/evaluate_shapes.py's own drawing
    code) whose shape the readout names right: how well the tower sees, before stage 2."""
    import random

    import evaluate_shapes

    rng = random.Random(seed)
    right = 0
    for start in range(0, count, 16):
        batch = []
        for _ in range(min(16, count - start)):
            image, label = evaluate_shapes.draw_fresh(rng)
            batch.append((image, (shapes.SHAPES.index(label[1]), 0, 0)))
        _, share = tower_loss(tower, readout, processor, batch)
        right += share.item() * len(batch)
    return right / count

