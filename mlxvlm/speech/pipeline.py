"""An answer spoken while it is written: ``AnswerSpeaker`` drives a family's stages
(``speech.stages``) interleaved with the thinker. After each token the thinker writes,
the talker text follower hands the talker what it can hear now (its prefill once the
answer's first token is fed, then one text row per token), the talker steps while it has
its text, and the codec decodes every few frames (a smaller first chunk), each chunk
continuing the last exactly. When the talker would need a row the thinker has not
written yet it waits for the next token, so its codes are those of a talker started
after the whole answer (``speak``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.media.decode_work import check_cancelled
from mlxvlm.models.layers.hidden_tap import HiddenTap
from mlxvlm.speech.stages import speech_stages
from mlxvlm.speech.talker import TalkerSampling


@dataclass
class Speech:
    audio: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int
    codes: np.ndarray  # (frames, code_groups), or (frames,) for one code per frame
    voice: str
    first_audio_seconds: float | None = None  # from the start (the speaker's) to the first chunk
    seconds: float = 0.0  # the talker and codec's own time
    chunks: list[np.ndarray] = field(default_factory=list)

    @property
    def audio_seconds(self) -> float:
        return len(self.audio) / self.sample_rate


def check_speaks(model) -> None:
    if not getattr(model, "speaks", False):
        raise MlxvlmError("this model does not speak: audio output needs a checkpoint with a "
                          "talker (e.g. Qwen3-Omni's or Qwen2.5-Omni's full model, not its "
                          "thinker alone)")


def speech_voice(model, voice: str | None) -> tuple[str, object]:
    """(the voice's name, what the family's stages speak it with)."""
    check_speaks(model)
    return speech_stages(model).resolve_voice(voice)


def hidden_tap(model) -> HiddenTap:
    """A tap for the thinker's states the talker reads (set it as the thinker decoder's
    ``hidden_tap`` while the answer is written)."""
    check_speaks(model)
    return HiddenTap(speech_stages(model).hidden_layer)


class AnswerSpeaker:
    """One answer's speech: ``wrote`` after each token the thinker writes, ``finish``
    after the last; each yields the waveform chunks decoded meanwhile. ``close`` frees the
    talker's and codec's state (a stopped answer's too)."""

    def __init__(self, model, tap: HiddenTap, prompt_tokens: int, eos_ids, *,
                 voice: str | None = None, talker_temperature: float | None = None,
                 max_frames: int = 4096, seed: int | None = None,
                 started: float | None = None):
        """``started``: the perf_counter time ``first_audio_seconds`` counts from (by
        default now)."""
        name, speaker = speech_voice(model, voice)
        stages = speech_stages(model)
        self.text = stages.text_follower(tap, prompt_tokens, speaker, eos_ids)
        self.talker = stages.talker(
            TalkerSampling.from_temperature(talker_temperature, max_frames, seed))
        self.codec = stages.codec(speaker)
        self.generated: list[int] = []
        self.frames: list[np.ndarray] = []
        self.speech = Speech(np.zeros(0, np.float32), self.codec.sample_rate,
                             stages.no_codes(), name)
        self._start = time.perf_counter() if started is None else started

    def wrote(self, token: int, finished: bool = False) -> Iterator[np.ndarray]:
        """The thinker wrote ``token`` (its last when ``finished``)."""
        self.generated.append(token)
        yield from self._run(finished)

    def finish(self) -> Iterator[np.ndarray]:
        """The rest of the speech, once the thinker has written its last token."""
        yield from self._run(True)
        chunks = len(self.speech.chunks)
        self.end()
        yield from self.speech.chunks[chunks:]

    def close(self) -> None:
        self.talker.close()
        self.codec = None
        mx.clear_cache()

    def hear(self, token: int, finished: bool = False) -> None:
        """The thinker wrote ``token`` (its last when ``finished``): the talker is handed
        the text it can hear now, and steps no further (``SpeechBatch`` steps it)."""
        self.generated.append(token)
        self._follow(finished)

    def ready(self) -> bool:
        """Whether the talker has the text its next frame needs (or has ended)."""
        return self.talker.ready()

    def frame(self) -> np.ndarray | None:
        """One frame of the talker: the chunk the codec decoded with it, if any (an empty
        array when none was decoded); None once the talker has ended."""
        started = time.perf_counter()
        return self.stepped(self.talker.step(), started)

    def stepped(self, frame: np.ndarray | None, started: float) -> np.ndarray | None:
        """The talker's step begun at ``started`` (perf_counter; its share of a batch's)
        gave ``frame``: ``frame``'s return, the talker and codec's time counted."""
        chunk = None if frame is None else self.took(frame)
        self.speech.seconds += time.perf_counter() - started
        return chunk

    def took(self, frame: np.ndarray) -> np.ndarray:
        """The talker spoke ``frame``: the codec's chunk decoded with it (empty if none)."""
        self.frames.append(frame)
        chunk = self.codec.push(frame)
        return np.zeros(0, np.float32) if chunk is None else self._emit(chunk)

    def end(self) -> Speech:
        """The whole speech once the talker has ended (the codec's last chunk included,
        in ``speech.chunks[-1]`` when it decoded one); the stages' state freed."""
        started = time.perf_counter()
        chunk = self.codec.flush()
        self.speech.seconds += time.perf_counter() - started
        if chunk is not None and len(chunk):
            self._emit(chunk)
        if self.frames:
            self.speech.codes = np.stack(self.frames)
        if self.speech.chunks:
            self.speech.audio = np.concatenate(self.speech.chunks).astype(np.float32)
        self.close()
        return self.speech

    def _follow(self, finished: bool) -> None:
        if not self.talker.finished:  # at its end of speech or max_frames: nothing to hear
            started = time.perf_counter()
            self.text.follow(self.talker, self.generated, finished)
            self.speech.seconds += time.perf_counter() - started

    def _run(self, finished: bool) -> Iterator[np.ndarray]:
        """The talker steps while it has its text; a chunk whenever the codec decodes one."""
        if self.talker.finished:
            return
        self._follow(finished)
        while self.talker.ready():
            # the server's request whose client went away stops here, frame by frame
            # (its cancel flag; nothing outside a request)
            check_cancelled("speaking the answer")
            chunk = self.frame()
            if chunk is None:
                break
            if len(chunk):
                yield chunk

    def _emit(self, chunk: np.ndarray) -> np.ndarray:
        if self.speech.first_audio_seconds is None:
            self.speech.first_audio_seconds = time.perf_counter() - self._start
        self.speech.chunks.append(chunk)
        return chunk


def speak(model, tap: HiddenTap, prompt_tokens: int, generated_ids: Sequence[int], eos_ids,
          **options) -> Speech:
    """The whole answer ``generated_ids`` (to the prompt of ``prompt_tokens`` tokens)
    spoken after it was written, from the thinker states ``tap`` recorded meanwhile
    (``options``: ``AnswerSpeaker``'s)."""
    generated = list(generated_ids)
    if not generated:
        raise MlxvlmError("there is no answer to speak (no tokens were generated)")
    speaker = AnswerSpeaker(model, tap, prompt_tokens, eos_ids, **options)
    try:
        speaker.generated = generated
        for _ in speaker.finish():
            pass
    finally:
        speaker.close()
    return speaker.speech
