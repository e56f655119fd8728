"""The answers being spoken at once, for whoever writes them together (the batching
engine): each joins with its ``AnswerSpeaker`` once its thinker row is prefilled, hears
its thinker's tokens as they are written (``heard``), and ``step`` gives every speaker
whose talker has the text it needs one frame, the codec's chunks with them, and ends the
speakers whose talker has ended.

The talkers of one model step as one batch (``TalkerBatch``): each ready talker's frame
is one forward pass per stage over all of them, their KV caches rows of one batched cache
from the step after their own prefill; a speaker's codes are those it speaks alone.

A speaker's own failure (its text, its codec) ends it alone; the others go on. A failed
pass of the batch (the model itself) fails the speakers it was stepping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from mlxvlm.speech.pipeline import AnswerSpeaker, Speech
from mlxvlm.speech.talker_batch import TalkerBatch


@dataclass
class SpokenStep:
    """What one speaker gave in a ``step`` (or its ``heard``)."""

    chunks: list[np.ndarray] = field(default_factory=list)  # samples decoded, in order
    speech: Speech | None = None  # the whole speech once it has ended (it has left)
    failure: BaseException | None = None  # its own failure (it has left)


class SpeechBatch:
    def __init__(self):
        self.speakers: dict[Hashable, AnswerSpeaker] = {}
        self.talkers: dict[tuple, TalkerBatch] = {}  # by the talker model stepped

    def __len__(self) -> int:
        return len(self.speakers)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.speakers

    def join(self, key: Hashable, speaker: AnswerSpeaker) -> None:
        self.speakers[key] = speaker

    def heard(self, key: Hashable, token: int, finished: bool = False) -> SpokenStep | None:
        """Speaker ``key``'s thinker wrote ``token`` (its last when ``finished``); a
        ``SpokenStep`` with the failure when its text could not be followed (it has left)."""
        speaker = self.speakers[key]
        try:
            speaker.hear(token, finished)
        except Exception as error:
            self.leave(key)
            return SpokenStep(failure=error)
        return None

    def ready(self) -> bool:
        """Whether a ``step`` would step any talker."""
        return any(speaker.ready() for speaker in self.speakers.values())

    def step(self) -> dict[Hashable, SpokenStep]:
        """One frame for every speaker ready for one, the talkers of one model in one
        batched step; what each gave, by key."""
        given: dict[Hashable, SpokenStep] = {}
        by_talker: dict[tuple, dict[Hashable, AnswerSpeaker]] = {}
        for key, speaker in self.speakers.items():
            if speaker.ready():
                by_talker.setdefault(_talker_key(speaker.talker), {})[key] = speaker
        for talker_key, speakers in by_talker.items():
            batch = self.talkers.get(talker_key)
            if batch is None:
                batch = self.talkers[talker_key] = TalkerBatch(next(iter(speakers.values())).talker)
            started = time.perf_counter()
            try:
                frames = batch.step({key: speaker.talker for key, speaker in speakers.items()})
            except Exception as error:
                for key in speakers:
                    given[key] = SpokenStep(failure=error)
                    self.leave(key)
                continue
            share = (time.perf_counter() - started) / len(speakers)
            for key, speaker in speakers.items():
                given[key] = self._spoke(key, speaker, frames[key], time.perf_counter() - share)
            if not len(batch):  # its speakers ended or failed before holding a row
                self.talkers.pop(talker_key, None)
        return given

    def _spoke(self, key: Hashable, speaker: AnswerSpeaker, frame, started: float) -> SpokenStep:
        outcome = SpokenStep()
        try:
            chunk = speaker.stepped(frame, started)
            if chunk is None:
                before = len(speaker.speech.chunks)
                outcome.speech = speaker.end()
                outcome.chunks.extend(speaker.speech.chunks[before:])
                self._left(key)
            elif len(chunk):
                outcome.chunks.append(chunk)
        except Exception as error:
            outcome.failure = error
            self.leave(key)
        return outcome

    def leave(self, key: Hashable) -> None:
        """Speaker ``key`` stops (its client left, or it failed): its state is freed."""
        speaker = self.speakers.get(key)
        if speaker is not None:
            self._left(key)
            speaker.close()

    def _left(self, key: Hashable) -> None:
        """Speaker ``key`` is no longer in the batch; its talker's row freed."""
        del self.speakers[key]
        for talker_key, batch in list(self.talkers.items()):
            if key in batch:
                batch.drop(key)
                if not len(batch):
                    del self.talkers[talker_key]

    def clear(self) -> None:
        for key in list(self.speakers):
            self.leave(key)


def _talker_key(stream) -> tuple:
    """Talkers batch together when they are the same family's streams of one model."""
    return type(stream), id(stream.talker)
