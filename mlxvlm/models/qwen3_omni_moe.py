"""Qwen3-Omni (Qwen team, 2025), the thinker: text out from text, images, video and audio.

Qwen2.5-Omni's design (``models/qwen2_5_omni.py``) on Qwen3 parts:

- Audio: the AuT encoder (``layers/qwen3_omni_audio.py``): a convolution stem over 1 s
  chunks, 13 tokens per second, attention within windows of a few chunks.
- Images and video: Qwen3-VL's vision tower (learned positions resampled to the grid,
  DeepStack taps added to the first decoder layers' hidden states).
- Text: the Qwen3-MoE decoder (mlx-lm's sparse MoE block) with interleaved M-RoPE, placed
  by TMRoPE: a video frame grid's temporal id is its time in seconds x
  ``position_id_per_seconds``, text resumes after a block's largest id, and a video's
  sound track is merged with its frames token by token in time order
  (``InterleavedAudioVideoSpan``), its block opened and closed by two tokens each.

Speech out: a full checkpoint (``talker_config`` and ``code2wav_config``, tensors
``talker.*`` and ``code2wav.*``) also loads the talker (``layers/qwen3_omni_talker.py``)
and code2wav (``layers/qwen3_omni_code2wav.py``) as ``talker`` and ``code2wav``, and
``speaks`` is True; ``mlxvlm.speech`` runs them. A thinker-only checkpoint, or one whose
config turns audio output off or whose tensors leave the speech parts out, loads the
thinker alone as before.

Checkpoints: the Hub's full model (``model_type: qwen3_omni_moe``; ``thinker_config``;
tensors ``thinker.{audio_tower,visual,model,lm_head}.*`` with one tensor per expert,
``talker.*``, ``code2wav.*``) and transformers' thinker alone
(``qwen3_omni_moe_thinker``; the module tree, experts as 3-D tensors). Names after
sanitize are mlx-community's: ``thinker.audio_tower.*``, ``thinker.vision_tower.*`` (the
mergers as Qwen3-VL names them: ``norm``, ``linear_fc1``/``2``,
``deepstack_merger_list``), ``thinker.language_model.model.*`` (experts stacked in
``mlp.switch_mlp``) and ``thinker.language_model.lm_head``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxvlm.models import qwen2_5_omni, qwen3_vl, qwen3_vl_moe
from mlxvlm.models.base import VisionLanguageModel
from mlxvlm.models.config_utils import text_config
from mlxvlm.models.layers.mrope_decoder import LanguageModel, VisionSpan, whole
from mlxvlm.models.layers.qwen3_omni_audio import (
    AudioEncoder,
    Qwen3AudioConfig,
    output_lengths,
    sanitize_conv_weights,
)
from mlxvlm.models.layers.qwen3_omni_code2wav import Code2Wav, Code2WavConfig
from mlxvlm.models.layers.qwen3_omni_talker import Talker, TalkerConfig
from mlxvlm.models.layers.qwen_vision import QwenVisionTransformer, convert_hf_weight
from mlxvlm.models.qwen_video import QwenVideoProcessor
from mlxvlm.models.weights import is_hf_naming, map_hf_weights, rename_prefix

THINKER = "thinker."
AUDIO_TOWER = "thinker.audio_tower."
VISION_TOWER = "thinker.vision_tower."
LM_HEAD = "thinker.language_model.lm_head.weight"
# Hugging Face name prefix (after the full model's "thinker." is dropped) -> ours;
# transformers' module tree first, which adapters are named after.
HF_PREFIXES = (
    ("model.audio_tower.", AUDIO_TOWER),
    ("audio_tower.", AUDIO_TOWER),
    ("model.visual.", VISION_TOWER),
    ("visual.", VISION_TOWER),
    ("model.language_model.", "thinker.language_model.model."),
    ("model.", "thinker.language_model.model."),
    ("lm_head.", "thinker.language_model.lm_head."),
)
# Names only Hugging Face checkpoints have (the audio tower's are the same in both).
HF_ONLY_PREFIXES = ("thinker.model.", "thinker.visual.", "thinker.lm_head.", "model.",
                    "visual.", "lm_head.", "audio_tower.")
MLX_PREFIXES = (VISION_TOWER, "thinker.language_model.")
# The full model's speech output, which the thinker does not use; mlx-community's
# conversions may carry it too.
SPEECH_OUTPUT = ("talker.", "code2wav.")
# Buffers recomputed here: rotary tables, the audio encoder's sinusoidal positions.
BUFFERS = ("inv_freq", "positional_embedding")
# The vision mergers' Hugging Face names -> Qwen3-VL's, as mlx-community names them.
MERGER_NAMES = (("merger_list.", "deepstack_merger_list."), (".ln_q.", ".norm."),
                (".mlp.0.", ".linear_fc1."), (".mlp.2.", ".linear_fc2."))

OMNI_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}


def text_config_from_hf(thinker: dict):
    """Qwen3-VL-MoE's decoder switches, with Qwen3-Omni's rope θ default and its
    router's ``norm_topk_prob`` (transformers reads it; Qwen3-VL-MoE's ignores it)."""
    text = qwen3_vl.text_config_from_hf(thinker, default_rope_theta=1_000_000.0)
    if text.num_experts == 0:
        raise ValueError("a qwen3_omni_moe text config must set num_experts")
    norm_topk_prob = text_config(thinker, 1_000_000.0).get("norm_topk_prob", True)
    return dataclasses.replace(text, norm_topk_prob=bool(norm_topk_prob))


@dataclass
class InterleavedAudioVideoSpan:
    """A video with its sound track (Qwen3-Omni's TMRoPE).

    In the prompt: ``<vision_bos><audio_bos>`` (two text positions), then the video's and
    the audio's tokens merged in time order — a video token first where the two share a
    time — then ``<audio_eos><vision_eos>`` after the largest id of the block's last run.
    Video tokens carry (time, row, column); audio tokens carry their time (one position
    per token) on all three axes. Positions are given to the block's tokens in that
    merged order, whatever the tokens are, as transformers' ``get_rope_index`` does.
    Keyed by the video token; ``write`` starts at the block's first token.
    """

    video: VisionSpan
    audio_tokens: int
    video_token: int
    audio_token: int

    def write(self, positions: np.ndarray, ids: np.ndarray, index: int, start: int,
              merge: int, text_after: str) -> tuple[int, int]:
        video = self.video.position_ids(merge, start)
        # float32 sums, as the reference adds them
        audio = np.arange(self.audio_tokens, dtype=np.float32) + np.float32(start)
        audio = np.broadcast_to(audio.astype(np.float64), (3, self.audio_tokens))
        n = video.shape[1] + self.audio_tokens
        block = ids[index: index + n]
        if (block.size != n or (block == self.video_token).sum() != video.shape[1]
                or (block == self.audio_token).sum() != self.audio_tokens):
            raise ValueError(
                f"the audio-video block at {index} does not hold the {video.shape[1]} video "
                f"and {self.audio_tokens} audio tokens its grid and sound track call for"
            )
        v = a = 0
        columns = []
        while v < video.shape[1] and a < self.audio_tokens:
            if video[0, v] <= audio[0, a]:
                columns.append(video[:, v])
                v += 1
            else:
                columns.append(audio[:, a])
                a += 1
        # The block's last run: a single token, or the tail left of one of the two.
        last = [columns[-1][:, None]] if columns else []
        for rest in (video[:, v:], audio[:, a:]):
            if rest.shape[1]:
                columns.extend(rest.T)
                last = [rest]
        positions[:, index: index + n] = np.stack(columns, axis=1)
        return index + n, whole(last[0].max().item() + 1)


class Thinker(nn.Module):
    """``thinker`` in checkpoints: the audio and vision towers and the text model."""

    def __init__(self, args: qwen2_5_omni.OmniArgs):
        super().__init__()
        self.audio_tower = AudioEncoder(args.audio)
        self.vision_tower = QwenVisionTransformer(args.vision)
        self.language_model = LanguageModel(args.text)


@dataclass(frozen=True)
class SpeechConfig:
    """What the talker needs of the full config beside its own: the thinker's special
    tokens that frame the talker's prompt."""

    talker: TalkerConfig
    code2wav: Code2WavConfig
    im_start_token_id: int
    im_end_token_id: int
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    user_token_id: int
    assistant_token_id: int

    @classmethod
    def from_hf(cls, config: dict) -> "SpeechConfig | None":
        """None for a config without the speech parts (or with audio output off)."""
        if (not config.get("enable_audio_output", True) or not config.get("talker_config")
                or not config.get("code2wav_config")):
            return None
        defaults = dict(im_start_token_id=151644, im_end_token_id=151645,
                        tts_pad_token_id=151671, tts_bos_token_id=151672,
                        tts_eos_token_id=151673, user_token_id=872, assistant_token_id=77091)
        return cls(talker=TalkerConfig.from_hf(config["talker_config"]),
                   code2wav=Code2WavConfig.from_hf(config["code2wav_config"]),
                   **{key: config.get(key, value) for key, value in defaults.items()})


class Model(qwen2_5_omni.Model):
    hf_prefixes = HF_PREFIXES
    mlx_prefixes = MLX_PREFIXES
    audio_config_class = Qwen3AudioConfig
    processor_class = "Qwen3OmniMoeProcessor"
    omni_tokens = OMNI_TOKENS
    # transformers maps qwen3_omni_moe to Qwen2VLVideoProcessor: its frame sampling
    # ("qwen2_vl") and preprocessing.
    video_processor_class = QwenVideoProcessor

    speech_config_class = SpeechConfig
    speech_parts = ("talker", "code2wav")
    # mlxvlm.speech.stages' name for this family's voices, talker text, talker and codec
    speech_stages = "qwen3_omni"

    def __init__(self, args: qwen2_5_omni.OmniArgs):
        VisionLanguageModel.__init__(self, args)
        self.thinker = Thinker(args)

    def attach_speech(self, speech: SpeechConfig) -> None:
        self.speech_config = speech
        self.talker = Talker(speech.talker)
        self.code2wav = Code2Wav(speech.code2wav)

    # The towers and the text model, where the Qwen-VL code looks for them.
    audio_tower = property(lambda self: self.thinker.audio_tower)
    vision_tower = property(lambda self: self.thinker.vision_tower)
    language_model = property(lambda self: self.thinker.language_model)

    @classmethod
    def text_config_from_hf(cls, config: dict):
        return text_config_from_hf(config)

    @classmethod
    def vision_config_from_hf(cls, config: dict):
        return qwen3_vl.vision_config_from_hf(config)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        model = super().from_config(config)
        model._experts_out_in = qwen3_vl_moe.experts_stored_out_in(config)
        return model

    # -- checkpoint -----------------------------------------------------------------

    @classmethod
    def is_hf_checkpoint(cls, weight_names: Iterable[str]) -> bool:
        return is_hf_naming(weight_names, HF_ONLY_PREFIXES, cls.mlx_prefixes)

    @classmethod
    def hf_to_mlx_name(cls, name: str) -> str:
        name = rename_prefix(name.removeprefix(THINKER), cls.hf_prefixes)
        if name.startswith(VISION_TOWER) and "merger" in name:
            for hf, ours in MERGER_NAMES:
                name = name.replace(hf, ours)
        return name

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        thinker = {k: v for k, v in weights.items() if not k.startswith(SPEECH_OUTPUT)}
        sanitized = map_hf_weights(
            thinker, self.hf_to_mlx_name,
            towers={VISION_TOWER: convert_hf_weight, AUDIO_TOWER: sanitize_conv_weights},
            skip_suffixes=BUFFERS,
            drop={LM_HEAD} if self.args.text.tie_word_embeddings else (),
        )
        sanitized = qwen3_vl_moe.stack_expert_modules(sanitized)
        sanitized = qwen3_vl_moe.split_experts(sanitized, self.args.text, self._experts_out_in)
        if self.speaks:
            sanitized.update(self._sanitize_speech(weights))
        return sanitized

    def _sanitize_speech(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """``talker.*`` with its experts stacked as mlx-lm's ``switch_mlp``, ``code2wav.*``
        in MLX's convolution layouts."""
        talker = {k: v for k, v in weights.items()
                  if k.startswith("talker.") and not k.endswith(BUFFERS)}
        talker = qwen3_vl_moe.stack_expert_modules(talker)
        talker = qwen3_vl_moe.split_experts(talker, self.speech_config.talker.text,
                                            self._experts_out_in)
        code2wav = {}
        for name, value in weights.items():
            if name.startswith("code2wav."):
                inner = name[len("code2wav."):]
                value = Code2Wav.sanitize(inner, value)
                if value is not None:
                    code2wav["code2wav." + Code2Wav.hf_to_mlx_name(inner)] = value
        return {**talker, **code2wav}

    def hf_split_modules(self, name: str):
        return None  # transformers' vision attention is one fused qkv, as ours

    def hf_module_name(self, name: str) -> str:
        if name.startswith(VISION_TOWER) and "merger" in name:
            # the mergers' Hugging Face names, inverted (module names end without a dot)
            hf = f"model.visual.{name[len(VISION_TOWER):]}."
            for theirs, ours in MERGER_NAMES:
                hf = hf.replace(ours, theirs)
            return hf[:-1]
        return VisionLanguageModel.hf_module_name(self, name)

    # -- the parts that differ from Qwen2.5-Omni --------------------------------------

    def audio_tokens(self, mel_frames: np.ndarray) -> np.ndarray:
        return output_lengths(mel_frames, self.args.audio.n_window)

    def frame_positions(self, grid_frames: int, seconds_per_grid: float) -> np.ndarray:
        """Each frame grid's time in seconds x ``position_id_per_seconds``, in float32
        and untruncated as transformers keeps it: a video sampled at a rate that does not
        divide the seconds evenly sits between integer positions (and so does all after)."""
        return (np.arange(grid_frames, dtype=np.float32) * np.float32(seconds_per_grid)
                * np.float32(self.args.position_id_per_seconds))

    def sound_track_span(self, video: VisionSpan, audio_tokens: int) -> InterleavedAudioVideoSpan:
        args = self.args
        return InterleavedAudioVideoSpan(video, audio_tokens, args.video_token_id,
                                         args.audio_token_id)


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
