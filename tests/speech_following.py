"""What both omni families' speech tests use to compare a talker that follows the thinker
with one started after the whole answer."""

from __future__ import annotations

import mlxvlm
from mlxvlm.generate.speech import thinker_states
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.speech import pipeline


def spoken_after_the_answer(loaded, messages, *, max_tokens: int, frames: int, **options):
    """The answer written with the tap set (no talker running), then spoken whole: the
    text's result and the one-shot speech."""
    model, processor = loaded
    talker_temperature = options.pop("talker_temperature", None)
    with thinker_states(model) as tap:
        text = mlxvlm.generate(model, processor, messages, max_tokens=max_tokens, **options)
    speech = pipeline.speak(model, tap, text.prompt_tokens, text.tokens,
                            eos_token_ids(processor), max_frames=frames,
                            seed=options.get("seed"), talker_temperature=talker_temperature)
    return text, speech


def streamed(loaded, messages, *, max_tokens: int, frames: int, **options):
    """``stream_generate``'s results with the talker following the thinker."""
    model, processor = loaded
    return list(mlxvlm.stream_generate(model, processor, messages, max_tokens=max_tokens,
                                       audio_output=True, talker_max_frames=frames, **options))
