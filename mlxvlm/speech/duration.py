"""How much speech a number of codec frames is: a speaking model's frames per second of
audio, and the frames a bound in seconds allows (the server's and the chat's bound on one
spoken answer, whose talker and codec keep working for as long as it is spoken)."""

from __future__ import annotations

import math

# What a served spoken answer may last unless the operator says otherwise: long enough
# for any answer a person listens to, short of holding the model for minutes per request.
DEFAULT_MAX_SPEECH_SECONDS = 120.0


def frames_per_second(model) -> float:
    """Codec frames per second of audio (12.5 for Qwen3-Omni: 1920 samples at 24 kHz;
    50 for Qwen2.5-Omni)."""
    # here, not at the top: the server's config reads this module's default, and needs
    # no codec for that
    from mlxvlm.speech.codec import SAMPLE_RATE
    from mlxvlm.speech.stages import speech_stages

    return SAMPLE_RATE / speech_stages(model).samples_per_frame


def frames_within(model, seconds: float) -> int:
    """The most frames whose audio lasts at most ``seconds`` (at least one)."""
    # the epsilon keeps 0.012 s x 1000 frames/s from flooring to 11
    return max(1, math.floor(seconds * frames_per_second(model) + 1e-9))
