"""A whole answer spoken, the stages one after another: the talker prompt from the
thinker's recorded states, the talker's frames, code2wav's chunks as frames arrive.

The thinker has finished writing before the talker starts here; a streaming orchestrator
(the server's, later) would drive the same stages interleaved, handing the talker each
text row as the thinker writes it (``TalkerStream.add_text``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.models.layers.hidden_tap import HiddenTap
from mlxvlm.speech.stages import speech_stages
from mlxvlm.speech.talker import TalkerSampling


@dataclass
class Speech:
    audio: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int
    codes: np.ndarray  # (frames, code_groups), or (frames,) for one code per frame
    voice: str
    first_audio_seconds: float | None = None  # from the talker's start to its first chunk
    seconds: float = 0.0  # the talker and codec's time
    chunks: list[np.ndarray] = field(default_factory=list)

    @property
    def audio_seconds(self) -> float:
        return len(self.audio) / self.sample_rate


def check_speaks(model) -> None:
    if not getattr(model, "speaks", False):
        raise MlxvlmError("this model does not speak: audio output needs a checkpoint with a "
                          "talker (e.g. Qwen3-Omni's or Qwen2.5-Omni's full model, not its thinker "
                          "alone)")


def speech_voice(model, voice: str | None) -> tuple[str, object]:
    """(the voice's name, what the family's stages speak it with)."""
    check_speaks(model)
    return speech_stages(model).resolve_voice(voice)


def hidden_tap(model) -> HiddenTap:
    """A tap for the thinker's states the talker reads (set it as the thinker decoder's
    ``hidden_tap`` while the answer is written)."""
    check_speaks(model)
    return HiddenTap(speech_stages(model).hidden_layer)


def speak(model, tap: HiddenTap, prompt_tokens: int, generated_ids, eos_ids, *,
          voice: str | None = None, talker_temperature: float | None = None,
          max_frames: int = 4096, on_chunk: Callable[[np.ndarray], None] | None = None) -> Speech:
    """The answer ``generated_ids`` (to the prompt of ``prompt_tokens`` tokens) spoken,
    from the thinker states ``tap`` recorded while it was written."""
    name, speaker = speech_voice(model, voice)
    stages = speech_stages(model)
    sampling = TalkerSampling.from_temperature(talker_temperature, max_frames)
    start = time.perf_counter()
    if any(ids is None for ids in tap.ids):
        raise MlxvlmError("speech output needs the prompt's token ids")
    ids = np.concatenate([np.asarray(i).reshape(-1) for i in tap.ids])
    generated = np.asarray(list(generated_ids), dtype=np.int64)
    if len(generated) == 0:
        raise MlxvlmError("there is no answer to speak (no tokens were generated)")
    fed = prompt_tokens + len(generated) - 1
    if len(ids) < fed:
        raise MlxvlmError("speech output needs the thinker's states of the whole prompt "
                          "(a reused prompt cache skips them)")
    embeddings, hidden = tap.states(fed)
    positions = None if tap.state is None else tap.state.positions(0, prompt_tokens)
    prompt = stages.talker_prompt(ids[:prompt_tokens], generated, embeddings, hidden,
                                  speaker, eos_ids, positions)
    talker = stages.talker(sampling)
    talker.add_text(prompt.trailing)
    talker.end_text(prompt.pad)
    codec = stages.codec(speaker)
    speech = Speech(np.zeros(0, np.float32), codec.sample_rate, stages.no_codes(), name)

    def emit(chunk):
        if chunk is None or not len(chunk):
            return
        if speech.first_audio_seconds is None:
            speech.first_audio_seconds = time.perf_counter() - start
        speech.chunks.append(chunk)
        if on_chunk is not None:
            on_chunk(chunk)

    frames = []
    talker.prefill(prompt.embeddings, prompt.positions)
    while (frame := talker.step()) is not None:
        frames.append(frame)
        emit(codec.push(frame))
    emit(codec.flush())
    mx.clear_cache()
    if frames:
        speech.codes = np.stack(frames)
    if speech.chunks:
        speech.audio = np.concatenate(speech.chunks).astype(np.float32)
    speech.seconds = time.perf_counter() - start
    return speech
