"""A speaking family's stages, picked by the name its model gives (``speech_stages``,
a class attribute: models/ cannot import these): how it names and resolves voices, which
thinker layer the talker reads, its samples of audio per frame, the follower that hands the talker its text as the
thinker writes (``follow(talker, generated, finished)``), its talker stream
(``prefill``, ``add_text``/``end_text``, ``ready``, ``step`` -> one frame or None at its
end, ``close``) and its codec (``push``/``flush``, ``sample_rate``). The pipeline
(``speech.pipeline``) drives any of them the same way."""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.speech import talker as qwen3_omni_talker
from mlxvlm.speech.codec import CodecStream
from mlxvlm.speech.qwen2_5_omni_codec import Token2WavStream
from mlxvlm.speech.qwen2_5_omni_prompt import TalkerText as Qwen25TalkerText
from mlxvlm.speech.qwen2_5_omni_talker import TalkerStream as Qwen25TalkerStream
from mlxvlm.speech.qwen3_omni_prompt import TalkerText
from mlxvlm.speech.spk_dict import load_voices
from mlxvlm.speech.voices import resolve_voice


class Qwen3OmniStages:
    """Speaker ids in the talker config (matched in any case), the talker following the
    thinker token by token, the code predictor's frames of ``num_code_groups`` codes,
    code2wav decoded in chunks."""

    def __init__(self, model):
        self.model = model
        self.config = model.speech_config.talker
        self.hidden_layer = self.config.accept_hidden_layer
        self.samples_per_frame = model.speech_config.code2wav.samples_per_frame

    def resolve_voice(self, voice: str | None) -> tuple[str, int]:
        return resolve_voice(self.config.speaker_id, voice)

    def text_follower(self, tap, prompt_tokens: int, speaker, eos_ids) -> TalkerText:
        return TalkerText(self.model, tap, prompt_tokens, speaker, eos_ids)

    def talker(self, sampling):
        return qwen3_omni_talker.TalkerStream(self.model.talker, sampling)

    def codec(self, speaker) -> CodecStream:
        return CodecStream(self.model.code2wav)

    def no_codes(self) -> np.ndarray:
        return np.zeros((0, self.config.num_code_groups), np.int64)


class Qwen25OmniStages:
    """Voices from the checkpoint's ``spk_dict.pt`` (matched exactly, as transformers
    does; transformers' default Chelsie), the thinker's last hidden state, the talker
    following the thinker token by token, one code per frame, token2wav decoded at the
    end (its DiT is not causal)."""

    DEFAULT_VOICE = "Chelsie"

    def __init__(self, model):
        self.model = model
        self.hidden_layer = model.args.text.num_hidden_layers  # after the final norm
        self.samples_per_frame = model.speech_config.token2wav.samples_per_code

    def voices(self) -> dict:
        voices = getattr(self.model, "_voices", None)
        if voices is None:
            path = getattr(self.model, "checkpoint_path", None)
            if path is None:
                raise MlxvlmError("this model was not loaded from a checkpoint directory, "
                                  "so its voices (spk_dict.pt) cannot be read")
            mel_dim = self.model.speech_config.token2wav.dit.mel_dim
            voices = self.model._voices = load_voices(path, mel_dim)
        return voices

    def resolve_voice(self, voice: str | None) -> tuple[str, Any]:
        voices = self.voices()
        if not voices:
            raise MlxvlmError("this model names no voices (its spk_dict.pt is empty)")
        name = voice if voice is not None else (
            self.DEFAULT_VOICE if self.DEFAULT_VOICE in voices else sorted(voices)[0])
        if name not in voices:
            raise MlxvlmError(f"unknown voice {voice!r}: this model's voices are "
                              f"{', '.join(sorted(voices))}")
        return name, voices[name]

    def text_follower(self, tap, prompt_tokens: int, speaker, eos_ids) -> Qwen25TalkerText:
        return Qwen25TalkerText(self.model, tap, prompt_tokens, speaker, eos_ids)

    def talker(self, sampling) -> Qwen25TalkerStream:
        return Qwen25TalkerStream(self.model.talker, sampling)

    def codec(self, speaker) -> Token2WavStream:
        return Token2WavStream(self.model.token2wav, speaker)

    def no_codes(self) -> np.ndarray:
        return np.zeros((0,), np.int64)


STAGES = {"qwen3_omni": Qwen3OmniStages, "qwen2_5_omni": Qwen25OmniStages}


def speech_stages(model):
    """The stages of a speaking ``model`` (one that ``speaks``)."""
    name = getattr(model, "speech_stages", None)
    if name not in STAGES:
        raise MlxvlmError(f"no speech stages for this model ({name!r})")
    return STAGES[name](model)
