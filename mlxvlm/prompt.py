"""Messages (text, image, video and audio parts) -> model inputs, through the model's own
chat template.

Accepted message shapes (OpenAI's and transformers'):

    {"role": "user", "content": "plain text"}
    {"role": "user", "content": [
        {"type": "text", "text": "What is in"},
        {"type": "image", "image": "cat.jpg"},          # also "url" / "path"
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
        {"type": "image"},                              # next item of the image= argument
        {"type": "video", "video": "clip.mp4"},         # also "video_url", or frames
        {"type": "audio", "audio": "speech.wav"},       # also "audio_url"
        {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}},
    ]}

Media are fed to the processor in the order they appear across the conversation, so an
image in a later turn lands at its own placeholder. Videos are decoded and sampled by
``mlxvlm.media.load_video`` and audio by ``load_audio`` (at the processor's rate); for an
omni processor (transformers' ``OmniModalProcessorMixin``) a video's sound track goes in
with its frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.media import MediaPolicy, load_audio, load_image, load_video
from mlxvlm.media.frame_sampling import sampler_for
from mlxvlm.prompt_length import check_prompt_length
from mlxvlm.text.tokenization import chat_template_owner, tokenizer_of

Message = dict[str, Any]

# Content part type -> the kind of media it carries.
MEDIA_PARTS = {
    "image": "image",
    "image_url": "image",
    "video": "video",
    "video_url": "video",
    "audio": "audio",
    "audio_url": "audio",
    "input_audio": "audio",
}
MEDIA_KINDS = ("image", "video", "audio")


@dataclass
class PreparedInputs:
    input_ids: mx.array  # (1, L) int32
    features: dict[str, mx.array] = field(default_factory=dict)
    prompt_text: str = ""
    num_images: int = 0
    num_videos: int = 0
    num_audios: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def build_messages(
    prompt: str | Sequence[Message],
    num_images: int = 0,
    system: str | None = None,
    *,
    num_videos: int = 0,
    num_audios: int = 0,
) -> list[Message]:
    """A plain prompt becomes one user turn with the images, videos and audio before the
    text."""
    if isinstance(prompt, str):
        counts = {"image": num_images, "video": num_videos, "audio": num_audios}
        content = [{"type": kind} for kind in MEDIA_KINDS for _ in range(counts[kind])]
        content.append({"type": "text", "text": prompt})
        messages: list[Message] = [{"role": "user", "content": content}]
    else:
        messages = list(prompt)
    if system is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _media_source(kind: str, part: dict) -> Any:
    """The source a content part names, or None (it takes the next passed-in item)."""
    url_key = f"{kind}_url"
    if part.get("type") == url_key or url_key in part:
        ref = part.get(url_key)
        return ref.get("url") if isinstance(ref, dict) else ref
    if kind == "audio" and (part.get("type") == "input_audio" or "input_audio" in part):
        ref = part.get("input_audio") or {}
        if not isinstance(ref, dict) or not ref.get("data"):
            return None
        return f"data:audio/{ref.get('format') or 'wav'};base64,{ref['data']}"
    for key in (kind, "url", "path"):
        if part.get(key) is not None:
            return part[key]
    return None


def normalize_media_messages(
    messages: Iterable[Message], extra: Mapping[str, Sequence[Any]] | None = None
) -> tuple[list[Message], list[tuple[str, Any]]]:
    """Template-ready messages (media parts reduced to {"type": kind}) and the media as
    ``(kind, source)`` in prompt order. A part without a source takes the next item of
    ``extra[kind]`` (the image=/video=/audio= arguments)."""
    pending = {kind: list((extra or {}).get(kind, ())) for kind in MEDIA_KINDS}
    media: list[tuple[str, Any]] = []
    normalized: list[Message] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise MlxvlmError(f"message {index} must be a dict with a 'role' and 'content'")
        content = message.get("content")
        if content is None or isinstance(content, str):
            normalized.append(dict(message))
            continue
        parts = []
        for part in _as_list(content):
            if isinstance(part, str):
                part = {"type": "text", "text": part}
            part_type = part.get("type")
            if part_type == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
                continue
            kind = MEDIA_PARTS.get(part_type)
            if kind is None:
                raise MlxvlmError(
                    f"message {index} has a content part of unsupported type {part_type!r} "
                    f"(supported: text, {', '.join(MEDIA_PARTS)})"
                )
            source = _media_source(kind, part)
            if source is None:
                if not pending[kind]:
                    raise MlxvlmError(
                        f"message {index} has {'an' if kind[0] in 'aeiou' else 'a'} {kind} "
                        f"part with no {kind}; give it a '{kind}' (path, URL or data URL) "
                        f"or pass {kind}=..."
                    )
                source = pending[kind].pop(0)
            media.append((kind, source))
            parts.append({"type": kind})
        normalized.append({**message, "content": parts})
    for kind, left in pending.items():
        if left:
            raise MlxvlmError(
                f"{len(left)} {kind}(s) were passed but the messages have no {kind} part "
                "left to place them"
            )
    return normalized, media


def normalize_messages(
    messages: Iterable[Message], extra_images: Sequence[Any] = ()
) -> tuple[list[Message], list[Any]]:
    """Template-ready messages (media parts reduced to {"type": kind}) and the image
    sources in prompt order (see ``normalize_media_messages`` for every kind). Parts
    without a source take the next of ``extra_images``."""
    normalized, media = normalize_media_messages(messages, {"image": extra_images})
    return normalized, [source for kind, source in media if kind == "image"]


def render_chat(processor: Any, messages: list[Message],
                chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The chat template's text for ``messages`` with the generation prompt;
    ``chat_template_kwargs`` are the template's own variables (``enable_thinking``)."""
    template_owner = chat_template_owner(processor)
    if template_owner is None:
        raise MlxvlmError(
            "this checkpoint has no chat template (chat_template.jinja or in "
            "tokenizer_config.json); add one, or pass a raw prompt with raw_prompt=True"
        )
    return template_owner.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )


def special_tokens_option(processor: Any, text: str) -> dict[str, bool]:
    """The processor option transformers' ``processor.apply_chat_template(...,
    tokenize=True)`` tokenizes the rendered chat ``text`` with.

    ``add_special_tokens=False`` when ``text`` starts with the tokenizer's BOS token (the
    template wrote it); otherwise no option, so the processor's default applies: the
    tokenizer adds what its post-processor adds (a Llama, Mistral or Gemma tokenizer's
    BOS; EOS too where it appends one). A tokenizer with no BOS token (Qwen's) always gets
    its special tokens. PaliGemma's processor places BOS itself and stops its tokenizer
    adding one, either way."""
    bos = tokenizer_of(processor).bos_token
    if bos is not None and text.startswith(bos):
        return {"add_special_tokens": False}
    return {}


def prepare_inputs(
    processor: Any,
    prompt: str | Sequence[Message],
    image: Any = None,
    *,
    video: Any = None,
    audio: Any = None,
    system: str | None = None,
    raw_prompt: bool = False,
    feature_names: Sequence[str] | None = None,
    media_policy: MediaPolicy | Mapping[str, Any] | None = None,
    video_options: dict | None = None,
    audio_in_video: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_context: int | None = None,
) -> PreparedInputs:
    """Render the conversation with the chat template and run the processor.

    ``image``, ``video``, ``audio``: one source or a list of them, for the media parts
    that name none (with a plain string prompt: placed before the text). A video given as
    a list of frames must itself be inside the list: ``video=[[frame, frame, ...]]``.
    ``media_policy``: where every image, video and audio may come from (a ``MediaPolicy``,
    or a mapping of its fields; an unknown name is a ``TypeError``). ``video_options``:
    ``load_video``'s (``fps``, ``max_frames``, ``max_pixels`` ...). ``audio_in_video``: an omni model also
    hears each video's sound track. ``chat_template_kwargs``: variables of the chat template
    (``{"enable_thinking": False}``, ``tools=[...]``). ``raw_prompt``: ``prompt`` is already the model's exact
    input text (media must then be passed as arguments and the text must hold the
    placeholders); it is tokenized as ``processor(text=prompt)`` does, with the
    processor's default special tokens. ``max_context``: the model's context; a text that
    cannot fit is a ``PromptTooLongError`` before it is tokenized whole or any medium is
    decoded (``prompt_length``).

    The rendered chat is tokenized as transformers' ``processor.apply_chat_template(...,
    tokenize=True)`` tokenizes it (see ``special_tokens_option``): a tokenizer that adds
    BOS gets its BOS unless the template already wrote it.
    """
    extra = {"image": _as_list(image), "video": _as_list(video), "audio": _as_list(audio)}
    if raw_prompt:
        if not isinstance(prompt, str):
            raise MlxvlmError("raw_prompt=True needs the prompt as a string")
        text = prompt
        media = [(kind, source) for kind in MEDIA_KINDS for source in extra[kind]]
    else:
        messages = build_messages(prompt, len(extra["image"]), system,
                                  num_videos=len(extra["video"]), num_audios=len(extra["audio"]))
        messages, media = normalize_media_messages(messages, extra)
        text = render_chat(processor, messages, chat_template_kwargs)

    check_prompt_length(tokenizer_of(processor), text, max_context)
    loaded = _load_media(processor, media, MediaPolicy.of(media_policy),
                         video_options or {}, audio_in_video)
    special = {} if raw_prompt else special_tokens_option(processor, text)
    outputs = processor(
        text=[text], return_tensors="np", **special, **loaded.processor_kwargs()
    )
    input_ids = mx.array(np.asarray(outputs["input_ids"]), dtype=mx.int32)
    features = {}
    for name, value in outputs.items():
        if name == "input_ids" or value is None:
            continue
        if feature_names is not None and name not in feature_names:
            continue
        features[name] = mx.array(np.asarray(value))
    return PreparedInputs(input_ids, features, text, len(loaded.images), len(loaded.videos),
                          len(loaded.standalone_audio))


@dataclass
class _LoadedMedia:
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)  # mlxvlm.media.Video
    standalone_audio: list = field(default_factory=list)  # mlxvlm.media.Audio
    # Every audio the processor hears, in prompt order, and for each the video it comes
    # from (None: an audio part of its own) -- transformers' omni processor API.
    audio_slots: list = field(default_factory=list)
    audio_from_video: list = field(default_factory=list)

    def processor_kwargs(self) -> dict:
        kwargs: dict[str, Any] = {"images": self.images or None}
        if self.videos:
            from transformers.video_utils import VideoMetadata

            kwargs["videos"] = [v.frames for v in self.videos]
            kwargs["video_metadata"] = [
                VideoMetadata(total_num_frames=v.total_frames, fps=v.source_fps,
                              duration=v.duration, frames_indices=v.frame_indices.tolist(),
                              width=v.frames.shape[2], height=v.frames.shape[1])
                for v in self.videos
            ]
        if self.audio_slots:
            kwargs["audio"] = [a.samples for a in self.audio_slots]
            if any(i is not None for i in self.audio_from_video):
                kwargs["load_audio_from_video"] = True
                kwargs["audio_from_video_indices"] = self.audio_from_video
        return kwargs


def _load_media(processor: Any, media: list[tuple[str, Any]], policy: MediaPolicy,
                video_options: dict, audio_in_video: bool) -> _LoadedMedia:
    """Decode every source, checking first that the processor takes its kind."""
    kinds = {kind for kind, _ in media}
    video_processor = getattr(processor, "video_processor", None)
    # transformers names it feature_extractor, or audio_processor (Phi-4-multimodal)
    feature_extractor = getattr(processor, "feature_extractor", None) or getattr(
        processor, "audio_processor", None)
    if "video" in kinds and video_processor is None:
        raise MlxvlmError("this model does not take video input; pass images or text")
    if "audio" in kinds and feature_extractor is None:
        raise MlxvlmError("this model does not take audio input")
    rate = getattr(feature_extractor, "sampling_rate", None)
    hears_video = audio_in_video and rate is not None and _is_omni(processor)
    # Frames as the family's transformers video processor samples them.
    sampler = sampler_for(video_processor) if video_processor is not None else None

    loaded = _LoadedMedia()
    for kind, source in media:
        if kind == "image":
            loaded.images.append(load_image(source, policy=policy))
        elif kind == "video":
            options = {**video_options, "with_audio": hears_video}
            if hears_video:
                options["audio_rate"] = rate
            video = load_video(source, policy=policy, sampler=sampler, **options)
            if hears_video and video.audio is not None:
                loaded.audio_slots.append(video.audio.resampled(rate))
                loaded.audio_from_video.append(len(loaded.videos))
            loaded.videos.append(video)
        else:
            sound = load_audio(source, sampling_rate=rate, policy=policy)
            loaded.standalone_audio.append(sound)
            loaded.audio_slots.append(sound)
            loaded.audio_from_video.append(None)
    return loaded


def _is_omni(processor: Any) -> bool:
    from transformers.processing_utils import OmniModalProcessorMixin

    return isinstance(processor, OmniModalProcessorMixin)
