"""An answer spoken (``audio_output``): the checks before the thinker runs and the tap
that records the thinker's states while it writes, which the talker follows
(``mlxvlm.speech.pipeline.AnswerSpeaker``, driven by ``generate_prepared``). Shared by
``generate``, the generate command and the server."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from mlxvlm.errors import MlxvlmError
from mlxvlm.speech.pipeline import hidden_tap, speech_voice

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
