"""The request body of ``POST /v1/audio/speech`` (OpenAI's text-to-speech shape)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mlxvlm.sampling.ranges import SAMPLING
from mlxvlm.server.schemas import StrictModel


class SpeechBody(StrictModel):
    model: str
    input: str = Field(min_length=1)  # at most --max-speech-input-chars (speech.say)
    voice: str | None = None  # None: the checkpoint's default voice
    # wav: a 16-bit mono WAV file; pcm: its raw little-endian samples (24 kHz)
    response_format: Literal["wav", "pcm"] = "wav"
    talker_temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    talker_max_frames: int | None = Field(default=None, ge=1)
    # mlxvlm's own, as chat completions' seed: the sampled talker's codes drawn from it
    seed: int | None = Field(default=None, **SAMPLING["seed"].pydantic())
