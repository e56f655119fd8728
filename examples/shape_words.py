"""Stage 2 of teaching the shapes demo: the language model learns to say what the tower sees.

The vision tower (taught in stage 1, examples/shape_tower.py) stays frozen, so each
training picture goes through the processor and the tower once: its conversation is
encoded as ``mlxvlm.finetune`` encodes one (``encode_conversation``: the chat template,
the loss on the answer's tokens only) and its image tokens are kept. Conversations of the
same length whose pictures have the same grid of tokens share their M-RoPE positions, so
a batch is drawn from one such group and runs through the language model as one
(B, L) tensor -- only the language model's weights train, the text embeddings with them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shape_tower  # noqa: E402
import shapes  # noqa: E402

import mlxvlm  # noqa: E402,F401  (sets up MLX's CPU backend before mlx.core loads)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402


class Group:
    """Conversations of one length whose images have one grid: their ids, loss masks and
    image tokens stacked, where the image tokens go, their shared M-RoPE state, and which
    of the conversations given they are (``members``)."""

    def __init__(self, state, positions: np.ndarray):
        self.ids, self.masks, self.features, self.members = [], [], [], []
        self.state = state
        self.start, self.stop = int(positions[0]), int(positions[-1]) + 1
        if not np.array_equal(positions, np.arange(self.start, self.stop)):
            raise ValueError("the image tokens of a conversation are not contiguous")

    def add(self, index: int, encoded, positions: np.ndarray, features: mx.array) -> None:
        if (int(positions[0]), int(positions[-1]) + 1) != (self.start, self.stop):
            raise ValueError("conversations of one length and grid place the image apart")
        self.members.append(index)
        self.ids.append(np.asarray(encoded.input_ids, dtype=np.int32))
        self.masks.append(np.asarray(encoded.loss_mask, dtype=np.float32))
        self.features.append(features)

    def stack(self) -> None:
        # Only the answers are scored: the output head runs from the first position that
        # predicts an answer token on.
        self.scored_from = min(int(np.flatnonzero(mask[1:])[0]) for mask in self.masks)
        self.ids = mx.array(np.stack(self.ids))
        self.masks = mx.array(np.stack(self.masks))
        self.features = mx.stack(self.features)
        mx.eval(self.features)


def conversations(processor, count: int, seed: int):
    """``count`` varied pictures, each with the question and its answer, encoded as
    ``mlxvlm.finetune`` encodes a record."""
    from mlxvlm.finetune.masking import encode_conversation

    rng = np.random.default_rng(seed)
    labels = shapes.classes(tuple(shapes.BACKGROUNDS))
    for _ in range(count):
        label = labels[int(rng.integers(len(labels)))]
        image = shapes.draw_varied(*label, rng=rng)
        yield encode_conversation(processor, shapes.conversation(shapes.describe(*label)), [image])


def group_conversations(model, encoded_conversations, log=print) -> list[Group]:
    """Run each conversation's picture through the (frozen) tower once and group them."""
    from mlxvlm.models import merge

    groups: dict[tuple, Group] = {}
    tic = time.perf_counter()
    count = 0
    for index, encoded in enumerate(encoded_conversations):
        count += 1
        ids = np.asarray(encoded.input_ids, dtype=np.int32)
        grid = np.asarray(encoded.features["image_grid_thw"]).reshape(1, 3)
        pixels = mx.array(encoded.features["pixel_values"])
        key = (len(ids), tuple(grid[0].tolist()))
        positions = merge.placeholder_positions(ids, model.args.image_token_id)
        if key not in groups:
            _, state = model.embed(mx.array(ids)[None], pixel_values=pixels, image_grid_thw=grid)
            groups[key] = Group(state, positions)
        features = model.vision_tower(pixels, grid)
        mx.eval(features)  # an unevaluated one would keep its picture's pixels alive
        groups[key].add(index, encoded, positions, features)
        if (index + 1) % 1000 == 0:
            log(f"encoded {index + 1} pictures, {time.perf_counter() - tic:.0f} s")
    for group in groups.values():
        group.stack()
    if not groups:
        raise ValueError("no conversations to train on")
    log(f"{count} pictures in {len(groups)} groups of one length and grid")
    return list(groups.values())


def batch_loss(language_model, group: Group, rows: mx.array) -> mx.array:
    """Mean cross-entropy over the answer tokens of ``rows`` of ``group``."""
    ids = group.ids[rows]
    embeddings = language_model.model.embed_tokens(ids)
    embeddings = mx.concatenate([embeddings[:, : group.start], group.features[rows],
                                 embeddings[:, group.stop :]], axis=1)
    hidden = language_model.model(ids[:, :-1], None, embeddings[:, :-1], group.state)
    logits = language_model.logits(hidden[:, group.scored_from :])
    losses = nn.losses.cross_entropy(logits.astype(mx.float32), ids[:, 1 + group.scored_from :])
    mask = group.masks[rows][:, 1 + group.scored_from :]
    return (losses * mask).sum() / mask.sum()


def train_words(model, processor, *, steps: int, pictures: int, batch_size: int = 16,
                learning_rate: float = 1e-3, seed: int = 0, log=print) -> None:
    """Teach ``model``'s language model (in place; the tower frozen) to describe
    ``pictures`` varied pictures: ``steps`` steps of Adam, on stage 1's schedule."""
    groups = group_conversations(model, conversations(processor, pictures, seed), log)
    sizes = np.array([len(g.ids) for g in groups], dtype=np.float64)
    language_model = model.language_model
    language_model.train()
    optimizer = optim.Adam(learning_rate=shape_tower.warmup_then_cosine(learning_rate, steps))
    step_fn = nn.value_and_grad(language_model, batch_loss)
    rng = np.random.default_rng(seed + 1)
    losses = []
    tic = time.perf_counter()
    for step in range(1, steps + 1):
        group = groups[rng.choice(len(groups), p=sizes / sizes.sum())]
        rows = mx.array(rng.integers(len(group.ids), size=batch_size))
        loss, grads = step_fn(language_model, group, rows)
        optimizer.update(language_model, grads)
        mx.eval(language_model.parameters(), optimizer.state, loss)
        losses = (losses + [loss.item()])[-100:]
        if step % 200 == 0 or step == steps:
            log(f"words step {step}/{steps}: loss {np.mean(losses):.4f} (last 100 steps), "
                f"{time.perf_counter() - tic:.0f} s")
    language_model.eval()
