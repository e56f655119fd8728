"""Stage 2 of teaching the shapes demo: the language model learns to say what the tower sees.

It learns from conversations as users hold them: most ask about one picture, the others
go on for two or three turns, each bringing a new picture or asking again, and every
answer is about the newest picture so far (``TURNS``). Each conversation is encoded as
``mlxvlm.finetune`` encodes one (``encode_conversation``: the chat template, the loss on
every answer's tokens only).

The vision tower (taught in stage 1, examples/shape_tower.py) stays frozen, so each
conversation goes through the processor and the tower once, and only its image tokens
and M-RoPE positions are kept. A batch is a run of conversations of about one length,
padded at the end and run through the language model as one (B, L) tensor, each row
with its own positions -- only the language model's weights train, the text embeddings
with them.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shape_tower  # noqa: E402
import shapes  # noqa: E402

import mlxvlm  # noqa: E402,F401  (sets up MLX's CPU backend before mlx.core loads)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402

# The kinds of conversation stage 2 draws, with their shares: per turn, whether it brings
# a new picture (True) or asks again about the latest (False). Without the later turns a
# model answers a second picture with the first one's description.
TURNS = (
    ((True,), 0.40),
    ((True, True), 0.25),
    ((True, False), 0.10),
    ((True, True, True), 0.05),
    ((True, True, False), 0.15),
    ((True, False, True), 0.05),
)
# The share of pictured turns whose question comes before the picture, as OpenAI clients
# often send it (at 0.2 a model got 93% of such chats against 98.5% the other way round).
TEXT_FIRST = 0.5


@dataclass
class Row:
    """One encoded conversation: its ids, loss mask and M-RoPE positions (3, L), where its
    image tokens are and the frozen tower's features for them."""

    ids: np.ndarray
    mask: np.ndarray
    positions: np.ndarray
    image_at: np.ndarray
    features: np.ndarray


@dataclass
class Batch:
    ids: mx.array  # (B, L) int32, padded at the end
    mask: mx.array  # (B, L) float32: 1 on the answers' tokens
    positions: mx.array  # (B, 3, L) int32
    is_image: mx.array  # (B, L, 1) bool
    features: mx.array  # (B, L, D): the tower's features at the image tokens, else 0


@dataclass
class RowPositions:
    """An ``MRopeState`` for a batch whose rows have positions of their own: the decoder's
    rotary tables take a batch's (B, 3, L) ids."""

    position_ids: mx.array
    deepstack = None

    def positions(self, offset: int, n: int) -> mx.array:
        return self.position_ids[..., offset : offset + n]


def draw_conversation(rng: np.random.Generator, labels: list,
                      draw=shapes.draw_varied) -> tuple[list[dict], list]:
    """One conversation of a kind drawn from ``TURNS``, answered throughout, and its
    pictures (``draw(colour, shape, background, rng=rng)``) in order."""
    kinds, shares = zip(*TURNS)
    pictured = kinds[rng.choice(len(kinds), p=shares)]
    answers, images, text_first = [], [], []
    for turn, picture in enumerate(pictured):
        if picture:
            label = labels[int(rng.integers(len(labels)))]
            images.append(draw(*label, rng=rng))
            if rng.random() < TEXT_FIRST:
                text_first.append(turn)
        answers.append(shapes.describe(*label))
    return shapes.chat(pictured, answers, text_first), images


def conversations(processor, count: int, seed: int):
    """``count`` conversations about varied pictures (``draw_conversation``), encoded as
    ``mlxvlm.finetune`` encodes a record."""
    from mlxvlm.finetune.masking import encode_conversation

    rng = np.random.default_rng(seed)
    labels = shapes.classes(tuple(shapes.BACKGROUNDS))
    for _ in range(count):
        yield encode_conversation(processor, *draw_conversation(rng, labels))


def encode_rows(model, encoded_conversations, log=print) -> list[Row]:
    """Run each conversation's pictures through the (frozen) tower once."""
    from mlxvlm.models import merge

    rows = []
    tic = time.perf_counter()
    for index, encoded in enumerate(encoded_conversations):
        ids = np.asarray(encoded.input_ids, dtype=np.int32)
        embeddings, state = model.embed(
            mx.array(ids)[None], pixel_values=mx.array(encoded.features["pixel_values"]),
            image_grid_thw=np.asarray(encoded.features["image_grid_thw"]))
        image_at = merge.placeholder_positions(ids, model.args.image_token_id)
        features = embeddings[0, mx.array(image_at)].astype(mx.float32)
        rows.append(Row(ids, np.asarray(encoded.loss_mask, dtype=np.float32),
                        np.asarray(state.position_ids, dtype=np.int32), np.asarray(image_at),
                        np.asarray(features)))
        if (index + 1) % 1000 == 0:
            log(f"encoded {index + 1} conversations, {time.perf_counter() - tic:.0f} s")
    if not rows:
        raise ValueError("no conversations to train on")
    log(f"encoded {len(rows)} conversations ({sum(len(r.image_at) for r in rows):,} image "
        f"tokens) in {time.perf_counter() - tic:.0f} s")
    return rows


def make_batch(rows: list[Row]) -> Batch:
    """``rows`` padded at the end to the longest: a real token never attends to padding
    (the mask is causal), and padding carries no loss."""
    length = max(len(r.ids) for r in rows)
    width = rows[0].features.shape[1]
    ids = np.zeros((len(rows), length), np.int32)
    mask = np.zeros((len(rows), length), np.float32)
    positions = np.zeros((len(rows), 3, length), np.int32)
    is_image = np.zeros((len(rows), length, 1), bool)
    features = np.zeros((len(rows), length, width), np.float32)
    for b, row in enumerate(rows):
        n = len(row.ids)
        ids[b, :n], mask[b, :n], positions[b, :, :n] = row.ids, row.mask, row.positions
        positions[b, :, n:] = row.positions[:, -1:] + np.arange(1, length - n + 1)
        is_image[b, row.image_at] = True
        features[b, row.image_at] = row.features
    return Batch(mx.array(ids), mx.array(mask), mx.array(positions), mx.array(is_image),
                 mx.array(features))


def batch_loss(language_model, batch: Batch) -> mx.array:
    """Mean cross-entropy over the answer tokens of ``batch``."""
    embeddings = language_model.model.embed_tokens(batch.ids)
    embeddings = mx.where(batch.is_image, batch.features.astype(embeddings.dtype), embeddings)
    state = RowPositions(batch.positions[..., :-1])
    hidden = language_model.model(batch.ids[:, :-1], None, embeddings[:, :-1], state)
    logits = language_model.logits(hidden)
    losses = nn.losses.cross_entropy(logits.astype(mx.float32), batch.ids[:, 1:])
    mask = batch.mask[:, 1:]
    return (losses * mask).sum() / mask.sum()


def train_words(model, processor, *, steps: int, conversations_count: int,
                batch_size: int = 16, learning_rate: float = 1e-3, seed: int = 0,
                log=print) -> None:
    """Teach ``model``'s language model (in place; the tower frozen) to answer
    ``conversations_count`` conversations about varied pictures: ``steps`` steps of Adam,
    on stage 1's schedule. Each batch is ``batch_size`` conversations next to each other
    in length order, from a random place."""
    rows = encode_rows(model, conversations(processor, conversations_count, seed), log)
    rows.sort(key=lambda r: len(r.ids))
    language_model = model.language_model
    language_model.train()
    optimizer = optim.Adam(learning_rate=shape_tower.warmup_then_cosine(learning_rate, steps))
    step_fn = nn.value_and_grad(language_model, batch_loss)
    rng = np.random.default_rng(seed + 1)
    losses = []
    tic = time.perf_counter()
    for step in range(1, steps + 1):
        start = int(rng.integers(max(1, len(rows) - batch_size + 1)))
        loss, grads = step_fn(language_model, make_batch(rows[start : start + batch_size]))
        optimizer.update(language_model, grads)
        mx.eval(language_model.parameters(), optimizer.state, loss)
        losses = (losses + [loss.item()])[-100:]
        if step % 200 == 0 or step == steps:
            log(f"words step {step}/{steps}: loss {np.mean(losses):.4f} (last 100 steps), "
                f"{time.perf_counter() - tic:.0f} s")
    language_model.eval()
