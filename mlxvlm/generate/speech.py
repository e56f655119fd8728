"""An answer spoken (``audio_output``): the checks before the thinker runs, the tap that
records the thinker's states while it writes, and the speech made from them after
(``mlxvlm.speech.pipeline``). Shared by ``generate`` and the generate command."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.speech.pipeline import Speech, hidden_tap, speak, speech_voice

DEFAULT_MAX_FRAMES = 4096


@dataclass(frozen=True)
class SpeechRequest:
    voice: str | None = None
    talker_temperature: float | None = None
    talker_max_frames: int = DEFAULT_MAX_FRAMES


def check_speech_request(model, request: SpeechRequest, options: dict[str, Any]) -> None:
    """Refuse what cannot be spoken before the answer is written: a model without a
    talker, an unknown voice, out-of-range values, a sharded model, speculation
    (``options``: stream_generate's keywords)."""
    speech_voice(model, request.voice)
    if request.talker_temperature is not None and request.talker_temperature < 0:
        raise MlxvlmError(
            f"talker_temperature must be at least 0, got {request.talker_temperature}")
    if request.talker_max_frames < 1:
        raise MlxvlmError(
            f"talker_max_frames must be at least 1, got {request.talker_max_frames}")
    if model.sharding is not None:
        raise MlxvlmError("audio output does not run on a sharded model")
    speculation = options.get("speculation")
    if (options.get("draft_model") is not None or options.get("prompt_lookup_num_tokens")
            or options.get("mtp") or (speculation is not None and speculation.enabled)):
        raise MlxvlmError("audio output does not run with speculative decoding: leave out "
                          "the draft model, prompt lookup and --mtp")


@contextmanager
def thinker_states(model) -> Iterator:
    """The thinker decoder's states recorded while the block runs (one answer at a time:
    the tap sees every pass of this model)."""
    decoder = model.language_model.model
    tap = decoder.hidden_tap = hidden_tap(model)
    try:
        yield tap
    finally:
        decoder.hidden_tap = None


def speak_answer(model, processor, tap, prompt_tokens: int, tokens, request: SpeechRequest,
                 started: float, on_chunk=None, on_frame=None) -> tuple[Speech, float | None]:
    """The answer spoken, and the seconds from ``started`` (perf_counter) to its first
    decoded audio; ``on_chunk(samples)`` as each chunk is decoded, ``on_frame(codes)`` as
    each frame is spoken."""
    text_done = time.perf_counter()
    speech = speak(model, tap, prompt_tokens, tokens, eos_token_ids(processor),
                   voice=request.voice, talker_temperature=request.talker_temperature,
                   max_frames=request.talker_max_frames, on_chunk=on_chunk,
                   on_frame=on_frame)
    first = None
    if speech.first_audio_seconds is not None:
        first = text_done - started + speech.first_audio_seconds
    return speech, first
