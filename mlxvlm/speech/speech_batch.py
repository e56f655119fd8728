"""The answers being spoken at once, for whoever writes them together (the batching
engine): each joins with its ``AnswerSpeaker`` once its thinker row is prefilled, hears
its thinker's tokens as they are written (``heard``), and ``step`` gives every speaker
whose talker has the text it needs one frame, the codec's chunks with them, and ends the
speakers whose talker has ended.

A speaker's own failure (its text, its codec) ends it alone; the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from mlxvlm.speech.pipeline import AnswerSpeaker, Speech


@dataclass
class SpokenStep:
    """What one speaker gave in a ``step`` (or its ``heard``)."""

    chunks: list[np.ndarray] = field(default_factory=list)  # samples decoded, in order
    speech: Speech | None = None  # the whole speech once it has ended (it has left)
    failure: BaseException | None = None  # its own failure (it has left)


class SpeechBatch:
    def __init__(self):
        self.speakers: dict[Hashable, AnswerSpeaker] = {}

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
        """One frame for every speaker ready for one; what each gave, by key."""
        given: dict[Hashable, SpokenStep] = {}
        for key, speaker in list(self.speakers.items()):
            if not speaker.ready():
                continue
            outcome = given[key] = SpokenStep()
            try:
                chunk = speaker.frame()
                if chunk is None:
                    before = len(speaker.speech.chunks)
                    outcome.speech = speaker.end()
                    outcome.chunks.extend(speaker.speech.chunks[before:])
                    del self.speakers[key]
                elif len(chunk):
                    outcome.chunks.append(chunk)
            except Exception as error:
                outcome.failure = error
                self.leave(key)
        return given

    def leave(self, key: Hashable) -> None:
        """Speaker ``key`` stops (its client left, or it failed): its state is freed."""
        speaker = self.speakers.pop(key, None)
        if speaker is not None:
            speaker.close()

    def clear(self) -> None:
        for key in list(self.speakers):
            self.leave(key)
