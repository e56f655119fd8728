"""Spoken requests in the batching engine. A spoken request is a row like any other; the
thinker states its talker reads are recorded by a tap of its own: set on the decoder for
its prefill's passes, and its row of each batched decode step (``RowsTap``; a text row
beside it records nothing). Once its row is prefilled its ``AnswerSpeaker`` joins one
``SpeechBatch``, hears each token as the engine delivers it, and the batch steps every
ready talker once per engine iteration; what a speaker says reaches its request as
``BatchAudio`` items between its text steps, the last one carrying the whole ``Speech``
once both its text and its speech are done.

The tap is per request because the talker needs the whole prompt's states: a spoken
request's prefix-cache entry keeps what its tap recorded (``TapRecords``), and a later
spoken request reusing that entry starts its tap from them (``tap_for``), recording only
its new positions. It never speculates (its thinker decodes a plain row)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from mlxvlm.generate.speech import SpeechRequest
from mlxvlm.models.layers.hidden_tap import HiddenTap, RowsTap, TapRecords
from mlxvlm.speech.pipeline import AnswerSpeaker, Speech, hidden_tap
from mlxvlm.speech.speech_batch import SpeechBatch, SpokenStep


@dataclass
class BatchAudio:
    """Samples a spoken request's codec decoded, delivered in order with its text steps;
    its last item (after its last ``BatchStep``, with no samples) carries the whole
    ``speech``."""

    chunk: np.ndarray  # float32 mono (empty on the last item)
    speech: Speech | None = None


class SpokenRows:
    """The engine's spoken requests (keyed by request id): their taps, their speakers in
    one ``SpeechBatch``, and the speeches that ended before their text did."""

    def __init__(self, model: Any):
        self.model = model
        self.batch = SpeechBatch()
        self.requests: dict[int, Any] = {}  # joined and not done: the engine's sequences
        self._ended: dict[int, Speech] = {}  # talker done, text still being written

    def __bool__(self) -> bool:
        return bool(self.requests)

    @staticmethod
    def tap_for(request: SpeechRequest | None, model: Any,
                reused: TapRecords | None = None) -> HiddenTap | None:
        """A spoken request's tap: from the records of the prefix it reuses, if any."""
        if request is None:
            return None
        tap = hidden_tap(model)
        if reused is None:
            return tap
        if reused.layer != tap.layer:
            raise ValueError(f"the reused records are of layer {reused.layer}, "
                             f"the talker reads layer {tap.layer}")
        return HiddenTap.resuming(reused)

    @contextmanager
    def recording(self, tap: HiddenTap | RowsTap | None) -> Iterator[None]:
        """The thinker's passes in the block recorded into ``tap`` (nothing if None)."""
        if tap is None:
            yield
            return
        decoder = self.model.language_model.model
        decoder.hidden_tap = tap
        try:
            yield
        finally:
            decoder.hidden_tap = None

    def rows_tap(self, rows: list[Any]) -> RowsTap | None:
        """The tap of a decode step over ``rows`` (None when none of them speaks)."""
        taps = [seq.tap for seq in rows]
        return RowsTap(taps) if any(tap is not None for tap in taps) else None

    def join(self, seq: Any, eos_ids: Any) -> None:
        """``seq``'s prompt is prefilled (its tap holds it): its speaker starts."""
        request: SpeechRequest = seq.speech
        speaker = AnswerSpeaker(self.model, seq.tap, seq.inputs.num_tokens, eos_ids,
                                voice=request.voice,
                                talker_temperature=request.talker_temperature,
                                max_frames=request.talker_max_frames, seed=seq.options.seed,
                                started=seq.submitted_at)
        self.batch.join(seq.handle.id, speaker)
        self.requests[seq.handle.id] = seq

    def heard(self, seq: Any, token: int, finished: bool) -> BaseException | None:
        """``seq``'s thinker wrote ``token``; its speaker's own failure, if it failed."""
        key = seq.handle.id
        if key not in self.batch:  # its talker has ended: nothing more to hear
            return None
        step = self.batch.heard(key, token, finished)
        return None if step is None else step.failure

    def step(self) -> list[tuple[Any, SpokenStep]]:
        """One frame for every ready talker; what each request's speaker gave."""
        if not self.batch.ready():
            return []
        return [(self.requests[key], given) for key, given in self.batch.step().items()]

    def ended(self, seq: Any, speech: Speech) -> Speech | None:
        """``seq``'s talker ended with ``speech``: the speech if the request is done (its
        text too), else None (kept for when its text is)."""
        if seq.written:
            self.forget(seq)
            return speech
        self._ended[seq.handle.id] = speech
        if seq.key is None:  # else its prefix-cache entry takes the records of all it feeds
            seq.tap = None  # its row records no more
        return None

    def written(self, seq: Any) -> Speech | None:
        """``seq``'s text is complete: its speech if its talker had already ended."""
        speech = self._ended.pop(seq.handle.id, None)
        if speech is not None:
            self.forget(seq)
        return speech

    def forget(self, seq: Any) -> None:
        """``seq`` is done, failed or gone: its speaker leaves (its stages freed)."""
        key = seq.handle.id
        seq.tap = None
        self.batch.leave(key)
        self.requests.pop(key, None)
        self._ended.pop(key, None)

    def clear(self) -> list[Any]:
        """Every speaker stopped; the requests they spoke for."""
        requests = list(self.requests.values())
        self.batch.clear()
        self.requests.clear()
        self._ended.clear()
        return requests
