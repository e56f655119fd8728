"""Qwen2.5-Omni (Xu et al., 2025), the thinker: text out from text, images, video and audio.

- Audio: a Whisper-style encoder (``layers/whisper_audio.py``), 25 tokens per second.
- Images and video: Qwen2.5-VL's vision tower (windowed attention, RMSNorm, SwiGLU).
- Text: the Qwen2 decoder with M-RoPE, positioned by TMRoPE — time-aligned M-RoPE: a
  video frame grid's temporal id is its time in seconds x ``position_id_per_seconds``
  (25), audio tokens advance one id per 40 ms, text resumes after a block's largest id,
  and a video's sound track is interleaved with its frames in ``seconds_per_chunk``
  chunks (``AudioVideoSpan`` in ``layers/mrope_decoder.py``).

Speech out: a full checkpoint (``enable_audio_output`` with ``talker_config`` and
``token2wav_config``, tensors ``talker.*`` and ``token2wav.*``) also loads the talker
(``layers/qwen2_5_omni_talker.py``) and token2wav (``layers/qwen2_5_omni_token2wav.py``)
as ``talker`` and ``token2wav``, and ``speaks`` is True; ``mlxvlm.speech`` runs them
(its stages ``"qwen2_5_omni"``), the voices read from the checkpoint's ``spk_dict.pt``.
A thinker-only checkpoint, or one whose config turns audio output off or whose tensors
leave the speech parts out, loads the thinker alone as before.

Checkpoints: the Hub's full model (``model_type: qwen2_5_omni``; ``thinker_config``;
tensors ``thinker.*``, ``talker.*``, ``token2wav.*``) and transformers' thinker alone
(``qwen2_5_omni_thinker``). Names after sanitize: ``audio_tower.*``, ``vision_tower.*``
(attention's q/k/v fused into ``qkv`` as in the Qwen-VL towers), ``language_model.model.*``
and ``language_model.lm_head`` unless tied. mlx-vlm has no port of this family, so these
follow mlxvlm's Qwen-VL names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import numpy as np

from mlxvlm.models import merge, qwen2_5_vl
from mlxvlm.models.config_utils import token_id
from mlxvlm.models.feature_cache import cached_features
from mlxvlm.models.layers.mrope_decoder import (
    AudioVideoSpan,
    LanguageModel,
    MRopeState,
    TextConfig,
    VisionSpan,
    mrope_position_ids,
)
from mlxvlm.models.layers.qwen2_5_omni_talker import Talker, TalkerConfig
from mlxvlm.models.layers.qwen2_5_omni_token2wav import Token2Wav, Token2WavConfig
from mlxvlm.models.layers.qwen_vision import (
    QwenVisionTransformer,
    VisionConfig,
    convert_hf_weight,
    grids_thw,
)
from mlxvlm.models.layers.whisper_audio import (
    AudioConfig,
    AudioEncoder,
    output_lengths,
    sanitize_conv_weights,
)
from mlxvlm.models.processor_utils import image_only, tokenizer_and_chat_template
from mlxvlm.models.qwen_vl_base import HF_PREFIXES as QWEN_VL_PREFIXES
from mlxvlm.models.qwen_vl_base import LM_HEAD, ModelArgs, QwenVLModel, join_deepstack
from mlxvlm.models.weights import fuse_linears, is_hf_naming, map_hf_weights

# Hugging Face name prefix -> ours (after "thinker." is dropped).
HF_PREFIXES = (("model.audio_tower.", "audio_tower."), *QWEN_VL_PREFIXES)
HF_ONLY_PREFIXES = ("thinker.", "talker.", "token2wav.", "model.", "visual.", "lm_head.")
# Parts of the Hub checkpoint the thinker does not use: speech output, and the audio
# tower's start/end embeddings, which only the talker reads.
UNUSED = ("talker.", "token2wav.")
UNUSED_AUDIO = "audio_bos_eos_token."
# Buffers recomputed here: rotary tables, the audio encoder's sinusoidal positions.
BUFFERS = ("inv_freq", "positional_embedding")

# The tokenizer attributes transformers' processor reads, for tokenizer configs that
# predate them.
OMNI_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}


def thinker_config(config: dict) -> dict:
    """The thinker's config, from the full model's (``thinker_config``) or its own."""
    return config.get("thinker_config") or config


def convert_audio_weight(name: str, value: mx.array) -> mx.array | None:
    """An audio-tower tensor (``name`` relative to it) in our layout; None: unused."""
    if name.startswith(UNUSED_AUDIO):
        return None
    return sanitize_conv_weights(name, value)


@dataclass(frozen=True)
class SpeechConfig:
    talker: TalkerConfig
    token2wav: Token2WavConfig

    @classmethod
    def from_hf(cls, config: dict) -> "SpeechConfig | None":
        """None for a config without the speech parts (or with audio output off)."""
        if (not config.get("enable_audio_output", True) or not config.get("talker_config")
                or not config.get("token2wav_config")):
            return None
        return cls(TalkerConfig.from_hf(config["talker_config"]),
                   Token2WavConfig.from_hf(config["token2wav_config"]))


@dataclass
class OmniArgs(ModelArgs):
    audio: AudioConfig | None = None
    audio_token_id: int = 151646
    audio_start_token_id: int = 151647
    vision_start_token_id: int = 151652
    position_id_per_seconds: int = 25
    seconds_per_chunk: float = 2


class Model(QwenVLModel):
    feature_names = (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "video_second_per_grid",
        "input_features",
        "feature_attention_mask",
    )
    hf_prefixes = HF_PREFIXES
    processor_class = "Qwen2_5OmniProcessor"
    # The tokenizer attributes the processor reads, for tokenizer configs without them.
    omni_tokens = OMNI_TOKENS
    audio_config_class = AudioConfig
    # Speech out: the config's speech parts, the modules (and tensor prefixes) they
    # load as, the stages mlxvlm.speech runs them with.
    speech_config_class = SpeechConfig
    speech_parts = ("talker", "token2wav")
    speech_stages = "qwen2_5_omni"
    speech_config = None

    def __init__(self, args: OmniArgs):
        super().__init__(args)
        self.vision_tower = QwenVisionTransformer(args.vision)
        self.language_model = LanguageModel(args.text)
        self.audio_tower = AudioEncoder(args.audio)

    def attach_speech(self, speech: SpeechConfig) -> None:
        self.speech_config = speech
        self.talker = Talker(speech.talker)
        self.token2wav = Token2Wav(speech.token2wav)

    @property
    def speaks(self) -> bool:
        """Whether the speech parts are loaded (``mlxvlm.speech`` runs them)."""
        return self.speech_config is not None

    @property
    def unused_weight_prefixes(self) -> tuple[str, ...]:
        return () if self.speaks else tuple(f"{part}." for part in self.speech_parts)

    def drop_absent_parts(self, weight_names) -> None:
        """A config with the speech parts over tensors without them (a thinker-only
        conversion): the thinker alone, as such a checkpoint always loaded."""
        if self.speaks and not any(name.startswith("talker.") for name in weight_names):
            for part in self.speech_parts:
                delattr(self, part)
            self.speech_config = None

    @classmethod
    def vision_config_from_hf(cls, config: dict) -> VisionConfig:
        return qwen2_5_vl.vision_config_from_hf(config)

    @classmethod
    def text_config_from_hf(cls, config: dict) -> TextConfig:
        return TextConfig.from_hf(config)

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        model = cls._thinker_from_config(config)
        speech = cls.speech_config_class.from_hf(config)
        if speech is not None:
            model.attach_speech(speech)
        return model

    @classmethod
    def _thinker_from_config(cls, config: dict) -> "Model":
        thinker = thinker_config(config)
        return cls(
            OmniArgs(
                text=cls.text_config_from_hf(thinker),
                vision=cls.vision_config_from_hf(thinker),
                audio=cls.audio_config_class.from_hf(thinker.get("audio_config") or {}),
                image_token_id=token_id(thinker, "image_token", 151655),
                video_token_id=token_id(thinker, "video_token", 151656),
                audio_token_id=token_id(thinker, "audio_token", 151646),
                audio_start_token_id=thinker.get("audio_start_token_id", 151647),
                vision_start_token_id=thinker.get("vision_start_token_id", 151652),
                position_id_per_seconds=thinker.get("position_id_per_seconds", 25),
                seconds_per_chunk=thinker.get("seconds_per_chunk", 2),
            )
        )

    # -- checkpoint -----------------------------------------------------------------

    @classmethod
    def is_hf_checkpoint(cls, weight_names: Iterable[str]) -> bool:
        # The full model's thinker, talker and token2wav are Hugging Face's names too.
        return is_hf_naming(weight_names, HF_ONLY_PREFIXES, cls.mlx_prefixes)

    @classmethod
    def hf_to_mlx_name(cls, name: str) -> str:
        return super().hf_to_mlx_name(name.removeprefix("thinker."))

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        """transformers' omni processor (``processor_class``: tokenizer, PIL image
        processor, Whisper feature extractor, chat template) with mlxvlm's numpy twin of
        the family's video processor (``video_processor_class``: Qwen2-VL's for both
        omni families, as transformers maps them)."""
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, WhisperFeatureExtractor

        tokenizer, chat_template = tokenizer_and_chat_template(model_path)
        if any(getattr(tokenizer, name, None) is None for name in cls.omni_tokens):
            tokenizer = AutoTokenizer.from_pretrained(model_path,
                                                      extra_special_tokens=cls.omni_tokens)
        return omni_processor_class(cls.processor_class)(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_path),
            video_processor=cls.video_processor_class.from_pretrained(model_path),
            feature_extractor=WhisperFeatureExtractor.from_pretrained(model_path),
            tokenizer=tokenizer,
            chat_template=chat_template,
        )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        sanitized = map_hf_weights(
            weights, self.hf_to_mlx_name,
            towers={"vision_tower.": convert_hf_weight, "audio_tower.": convert_audio_weight},
            skip_prefixes=UNUSED, skip_suffixes=BUFFERS,
            drop={LM_HEAD} if self.args.text.tie_word_embeddings else (),
        )
        if self.speaks:
            sanitized.update(self._sanitize_speech(weights))
        return fuse_vision_qkv(sanitized)

    def _sanitize_speech(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """``talker.*`` as the Hub names it (our modules' names), ``token2wav.*`` in MLX's
        convolution layouts; recomputed buffers dropped."""
        speech = {}
        for name, value in weights.items():
            if name.startswith("talker.") and not name.endswith(BUFFERS):
                speech[name] = value
            elif name.startswith("token2wav."):
                value = Token2Wav.sanitize(name[len("token2wav."):], value)
                if value is not None:  # float32 whatever the checkpoint's, as transformers
                    speech[name] = value.astype(mx.float32)
        return speech

    def hf_split_modules(self, name: str) -> tuple[tuple[str, int], ...] | None:
        """A vision block's fused ``attn.qkv``: transformers' ``attn.q``, ``attn.k`` and
        ``attn.v``, each as wide as the tower."""
        block, _, leaf = name.rpartition(".")
        if leaf != "qkv" or not name.startswith("vision_tower.blocks."):
            return None
        hf_block = super().hf_module_name(block)
        return tuple((f"{hf_block}.{part}", self.args.vision.hidden_size) for part in "qkv")

    def hf_module_name(self, name: str) -> str:
        if self.hf_split_modules(name) is not None:
            raise NotImplementedError(
                f"{name!r} is three linear layers in transformers (q, k, v); see hf_split_modules"
            )
        return super().hf_module_name(name)

    # -- the contract -----------------------------------------------------------------

    def embed(
        self,
        input_ids: mx.array,
        video_second_per_grid: Any = None,
        input_features: Any = None,
        feature_attention_mask: Any = None,
        **vision: Any,
    ) -> tuple[mx.array, MRopeState]:
        """``vision``: the processor's images and videos (see ``embed_vision``)."""
        args = self.args
        h, ids, (image_grids, video_grids), taps = self.embed_vision(input_ids, **vision)
        mel_frames = None
        if input_features is not None:
            h, mel_frames = self._merge_audio(h, ids, input_features, feature_attention_mask)
        elif (ids == args.audio_token_id).any():
            raise ValueError("the prompt has audio placeholder tokens but no audio features")
        state = self.rope_state(ids, image_grids, video_grids, video_second_per_grid, mel_frames)
        state.deepstack = join_deepstack(taps)  # Qwen3-Omni's tower taps DeepStack rows
        return h, state

    def rope_state(self, ids: np.ndarray, image_grid_thw: Any = None, video_grid_thw: Any = None,
                   video_second_per_grid: Any = None, mel_frames: Any = None) -> MRopeState:
        """TMRoPE positions of the prompt ``ids``; ``mel_frames``: each audio's length in
        mel frames (the feature attention mask's sums)."""
        args = self.args
        ids = np.asarray(ids).reshape(-1)
        audio_tokens = (np.zeros(0, np.int64) if mel_frames is None
                        else self.audio_tokens(mel_frames))
        spans = {
            args.image_token_id: [VisionSpan(tuple(g)) for g in grids_thw(image_grid_thw)],
            args.video_token_id: self._video_spans(ids, grids_thw(video_grid_thw),
                                                   video_second_per_grid, audio_tokens),
        }
        merge = args.vision.spatial_merge_size
        position_ids, delta = mrope_position_ids(ids, spans, merge, text_after="max")
        return MRopeState(mx.array(position_ids), delta)

    def audio_tokens(self, mel_frames: np.ndarray) -> np.ndarray:
        """How many tokens the audio encoder makes of audios of ``mel_frames`` frames."""
        return output_lengths(mel_frames)

    def frame_positions(self, grid_frames: int, seconds_per_grid: float) -> np.ndarray:
        """The temporal position of each of a video's frame grids: its time in seconds x
        ``position_id_per_seconds``, truncated from float32 as the reference computes it."""
        return (np.arange(grid_frames, dtype=np.float32) * np.float32(seconds_per_grid)
                * np.float32(self.args.position_id_per_seconds)).astype(np.int64)

    def sound_track_span(self, video: VisionSpan, audio_tokens: int):
        """A video and its sound track of ``audio_tokens`` tokens, interleaved in
        ``seconds_per_chunk`` time chunks (TMRoPE)."""
        args = self.args
        return AudioVideoSpan(
            video=video,
            audio_tokens=audio_tokens,
            tokens_per_chunk=int(args.position_id_per_seconds * args.seconds_per_chunk),
            video_token=args.video_token_id,
            audio_token=args.audio_token_id,
        )

    # -- helpers ----------------------------------------------------------------------

    def _merge_audio(self, h, ids, input_features, feature_attention_mask):
        """Encode every audio's valid mel frames; put the tokens at the audio placeholders
        in order. Returns the embeddings and each audio's length in mel frames."""
        features = np.asarray(input_features, dtype=np.float32)  # (audios, mel bins, frames)
        if feature_attention_mask is None:
            mel_frames = np.full(features.shape[0], features.shape[-1], dtype=np.int64)
        else:
            mel_frames = np.asarray(feature_attention_mask).reshape(features.shape[0], -1).sum(-1)
        valid = np.concatenate([f[:, :n] for f, n in zip(features, mel_frames)], axis=1)
        # One cache entry for the prompt's audio as a whole: the encoder pads every audio's
        # windows to the longest of them all, so one audio's tokens may depend on the others.
        [(tokens,)] = cached_features(
            self, "audio", [(valid, mel_frames)],
            lambda _: [(self.audio_tower(mx.array(valid), mel_frames),)],
        )
        positions = merge.placeholder_positions(ids, self.args.audio_token_id)
        h = merge.merge_features(h, positions, tokens, "audio placeholder tokens",
                                 source="the audio encoder")
        return h, mel_frames

    def _video_spans(self, ids, video_grids, second_per_grid, audio_tokens) -> list:
        """One span per video in prompt order: its frame grids at their times, and, for a
        video whose block opens ``<vision_bos><audio_bos>``, its sound track interleaved."""
        args = self.args
        # transformers' processor default: 2 fps, two frames per grid
        seconds = np.ones(len(video_grids), np.float32)
        if second_per_grid is not None:
            seconds = np.asarray(second_per_grid, dtype=np.float32).reshape(-1)
        opening = (args.video_token_id, args.audio_start_token_id)
        video_starts = [i for i in np.flatnonzero(ids == args.vision_start_token_id)
                        if i + 1 < ids.size and ids[i + 1] in opening]
        if len(video_starts) != len(video_grids):
            raise ValueError(f"the prompt has {len(video_starts)} video blocks but features "
                             f"for {len(video_grids)} videos")
        audio_index = np.cumsum(ids == args.audio_start_token_id) - 1  # slot of each bos
        spans = []
        for v, (grid, start) in enumerate(zip(video_grids, video_starts)):
            times = self.frame_positions(int(grid[0]), float(seconds[v]))
            video = VisionSpan(tuple(grid), frame_positions=tuple(times.tolist()))
            if ids[start + 1] != args.audio_start_token_id:
                spans.append(video)
                continue
            slot = int(audio_index[start + 1])
            if slot >= len(audio_tokens):
                raise ValueError(f"video {v} has a sound-track block but no audio features")
            spans.append(self.sound_track_span(video, int(audio_tokens[slot])))
        return spans


@functools.cache
def omni_processor_class(name: str):
    """transformers' omni processor ``name`` (Qwen2.5-Omni's, Qwen3-Omni's), without
    torchvision, taking each video's seconds per frame grid from how it was sampled."""
    import transformers
    from transformers import BatchFeature

    class OmniProcessor(image_only(getattr(transformers, name))):
        def _process_videos(self, videos, audio=None, processed_audio=None,
                            video_to_audio_indices=None, **kwargs):
            # transformers assumes one fps (2 by default) for every video; mlxvlm's
            # video metadata says what each was sampled at, so process them one by one.
            videos_kwargs = kwargs["videos_kwargs"]
            metadata = videos_kwargs.get("video_metadata")
            if not metadata:
                return super()._process_videos(videos, audio, processed_audio,
                                               video_to_audio_indices, **kwargs)
            parts, replacements = [], []
            for index, (video, meta) in enumerate(zip(videos, metadata)):
                one = {**kwargs, "videos_kwargs": {**videos_kwargs, "fps": meta.sampled_fps,
                                                   "video_metadata": [meta]}}
                to_audio = (None if video_to_audio_indices is None
                            else [video_to_audio_indices[index]])
                data, replacement = super()._process_videos(
                    [video], audio, processed_audio, to_audio, **one)
                parts.append(data)
                replacements += replacement
            merged = {
                "pixel_values_videos": np.concatenate(
                    [np.asarray(d["pixel_values_videos"]) for d in parts]),
                "video_grid_thw": np.concatenate([np.asarray(d["video_grid_thw"]) for d in parts]),
                "video_second_per_grid": [s for d in parts for s in d["video_second_per_grid"]],
            }
            return BatchFeature(merged), replacements

    return OmniProcessor


def fuse_vision_qkv(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The vision blocks' separate attention ``q`` / ``k`` / ``v`` tensors as one ``qkv``,
    stacked along the output, as the Qwen-VL towers store them."""
    return fuse_linears(weights, "vision_tower.blocks.", ("q", "k", "v"), "qkv")


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
