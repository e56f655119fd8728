"""Records -> checked training examples, and the order they are trained in.

Every record is encoded once before training (images decoded, chat template, processor,
loss mask), so that a bad record -- a missing image, no assistant turn, too many tokens --
is reported with its line before the first step rather than hours into a run. Only the
sizes are kept; a batch encodes its records again, so memory does not grow with the
dataset.

The order is a pure function of (seed, epoch): resuming at any step sees the same batches
as an uninterrupted run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.finetune.data import BadRecord, BadRecordsError, Record, RecordSource
from mlxvlm.finetune.masking import EncodedConversation, encode_conversation
from mlxvlm.media import load_image
from mlxvlm.prompt import normalize_media_messages


def conversation(record: Record) -> tuple[list[dict], list[Any]]:
    """Template-ready messages and the record's decoded images, in prompt order."""
    messages = record.messages
    if not isinstance(messages, list) or not messages:
        raise MlxvlmError("'messages' must be a non-empty list of {role, content} objects")
    images = record.images
    if images is not None and not isinstance(images, (list, tuple)):
        images = [images]
    messages, media = normalize_media_messages(messages, {"image": list(images or [])})
    other = sorted({kind for kind, _ in media if kind != "image"})
    if other:
        raise MlxvlmError(f"only image parts can be trained on, not {', '.join(other)}")
    return messages, [load_image(record.resolve(source)) for _, source in media]


def encode_record(record: Record, processor: Any) -> EncodedConversation:
    messages, images = conversation(record)
    return encode_conversation(processor, messages, images)


@dataclass
class Example:
    record: int  # index into the record source
    num_tokens: int
    num_loss_tokens: int


class ExampleSet:
    """The usable records of one source, with their sizes."""

    def __init__(self, records: RecordSource, processor: Any, examples: list[Example],
                 skipped: list[BadRecord]):
        self.records = records
        self.processor = processor
        self.examples = examples
        self.skipped = skipped

    def __len__(self) -> int:
        return len(self.examples)

    def encode(self, index: int) -> EncodedConversation:
        return encode_record(self.records[self.examples[index].record], self.processor)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.examples)


def prepare_examples(
    records: RecordSource,
    processor: Any,
    *,
    max_seq_length: int,
    skip_bad_records: bool = False,
    progress: Callable | None = None,
) -> ExampleSet:
    """Encode every record once; collect the bad ones (and raise unless skipping)."""
    bad = list(records.unparsable)
    examples = []
    indices = range(len(records))
    for index in progress(indices) if progress else indices:
        record = records[index]
        try:
            encoded = encode_record(record, processor)
        except Exception as exc:  # a record's content can fail anywhere; report, go on
            bad.append(BadRecord(record.location, _one_line(exc)))
            continue
        if encoded.num_tokens > max_seq_length:
            bad.append(BadRecord(
                record.location,
                f"{encoded.num_tokens} tokens, more than --max-seq-length {max_seq_length}",
            ))
            continue
        if encoded.num_loss_tokens == 0:
            bad.append(BadRecord(record.location, "no assistant token to learn from"))
            continue
        examples.append(Example(index, encoded.num_tokens, encoded.num_loss_tokens))
    if bad and not skip_bad_records:
        raise BadRecordsError(bad)
    if not examples:
        raise MlxvlmError(f"{records.name} has no usable record")
    return ExampleSet(records, processor, examples, bad)


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, MlxvlmError):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class BatchOrder:
    """Which examples make micro-batch ``m``: epochs of ``ceil(n / batch_size)`` batches,
    each epoch a fresh permutation drawn from (seed, epoch); the last batch of an epoch
    may be smaller."""

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.batches_per_epoch = math.ceil(num_examples / batch_size)
        self._permutation: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._permutation is None or self._permutation[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._permutation = (epoch, rng.permutation(self.num_examples))
        return self._permutation[1]

    def batch(self, m: int) -> list[int]:
        epoch, b = divmod(m, self.batches_per_epoch)
        order = self.permutation(epoch)
        return order[b * self.batch_size : (b + 1) * self.batch_size].tolist()


def evaluation_batches(num_examples: int, batch_size: int, num_batches: int) -> list[list[int]]:
    """The validation set in file order, in batches; ``num_batches`` -1 means all."""
    batches = [
        list(range(start, min(start + batch_size, num_examples)))
        for start in range(0, num_examples, batch_size)
    ]
    return batches if num_batches < 0 else batches[:num_batches]
