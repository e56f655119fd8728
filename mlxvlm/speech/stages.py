"""The stages a speaking family provides the pipeline, found by the family's
``speech_stages`` name (models/ cannot import speech/, so a family names its stages and
this table builds them):

- ``text(model, tap, prompt_tokens, speaker_id, eos_ids)``: the follower of the thinker,
  with ``follow(talker, generated, finished)`` handing the talker its prefill and text
  rows as the thinker writes and feeds the answer;
- ``talker(model, sampling)``: a stream with ``prefill``, ``add_text``/``end_text``,
  ``ready``, ``step`` -> one frame of codes or None at its end, ``close``;
- ``codec(model)``: frames in, waveform chunks out (``push``/``flush``, ``sample_rate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mlxvlm.errors import MlxvlmError
from mlxvlm.speech.codec import CodecStream
from mlxvlm.speech.qwen3_omni_prompt import TalkerText
from mlxvlm.speech.talker import TalkerStream


@dataclass(frozen=True)
class SpeechStages:
    text: Callable[..., Any]
    talker: Callable[..., Any]
    codec: Callable[..., Any]


STAGES = {
    "qwen3_omni": SpeechStages(
        text=TalkerText,
        talker=lambda model, sampling: TalkerStream(model.talker, sampling),
        codec=lambda model: CodecStream(model.code2wav),
    ),
}


def stages_of(model) -> SpeechStages:
    name = getattr(model, "speech_stages", None)
    if name not in STAGES:
        raise MlxvlmError(f"no speech stages for this model ({name!r})")
    return STAGES[name]
