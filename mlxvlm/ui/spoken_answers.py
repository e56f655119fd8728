"""A speaking model's answers in the chat (a Qwen3-Omni checkpoint with its talker).

The chat's speech controls (``SpeechSettings``: speak answers or not, the voice, the
talker's temperature) are shown only for a model that speaks. A spoken turn goes through
the session's batching engine as the server's spoken answers do (``submit(speech=)``:
the talker follows the thinker token by token on the engine's thread); the stop button
cancels it, and the engine stops its row and its talker at its next step. It reuses the
prefix an earlier spoken turn left (that entry keeps the thinker states the talker
reads; a text turn's does not, and a spoken turn after one prefills whole). The text streams
into the chat as it is written; then the audio comes as a message of its own: a 24 kHz
16-bit WAV written in the app's private folder (``Uploads.keep_answer_audio``), which
Gradio's Chatbot plays with its audio player and the /chat API hands out as a file.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import mlx.core as mx

from mlxvlm.batching import BatchAudio, BatchStep
from mlxvlm.generate.speech import SpeechRequest, check_speech_request
from mlxvlm.sampling import SamplingOptions
from mlxvlm.speech.duration import DEFAULT_MAX_SPEECH_SECONDS, frames_within
from mlxvlm.speech.talker import DEFAULT_TEMPERATURE
from mlxvlm.speech.voices import resolve_voice, voice_names
from mlxvlm.speech.wav import wav_bytes
from mlxvlm.ui.stats import AnswerStats
from mlxvlm.ui.thoughts import ThoughtsAndAnswer
from mlxvlm.ui.uploads import process_uploads

if TYPE_CHECKING:
    from mlxvlm.ui.session import ChatSession

# The box under the written answer while its audio is being made (display-only: the
# conversation leaves titled messages out of the prompt).
SPEAKING_TITLE = "🔊 Speaking…"
# The talker's temperature control starts at the checkpoint's own sampling
# (transformers' default for Qwen3-Omni's talker), as the API's talker_temperature does
# when left out.
TALKER_TEMPERATURE = DEFAULT_TEMPERATURE


@dataclass(frozen=True)
class SpeechSettings:
    """The speech controls, as the chat function receives them."""

    speak: bool = True
    voice: str | None = None  # None: the checkpoint's default voice
    talker_temperature: float | None = None  # None: the checkpoint's own sampling

    @classmethod
    def from_controls(cls, speak, voice, talker_temperature) -> "SpeechSettings":
        return cls(speak=True if speak is None else bool(speak),
                   voice=(voice or "").strip() or None,
                   talker_temperature=None if talker_temperature is None
                   else float(talker_temperature))


def speaks(model: Any) -> bool:
    return bool(getattr(model, "speaks", False))


def voices(model: Any) -> tuple[list[str], str | None]:
    """The voice picker's choices and its first value (the API's default voice); none
    for a model that does not speak."""
    if not speaks(model):
        return [], None
    speakers = model.speech_config.talker.speaker_id
    return voice_names(speakers), resolve_voice(speakers, None)[0]


def speech_request(model: Any, speech: SpeechSettings,
                   max_seconds: float = DEFAULT_MAX_SPEECH_SECONDS) -> SpeechRequest:
    """What the talker is asked for; ``MlxvlmError`` for an unknown voice (naming the
    voices) or a negative temperature. At most ``max_seconds`` of audio: the session's
    answers come one at a time."""
    request = SpeechRequest(speech.voice, speech.talker_temperature,
                            frames_within(model, max_seconds))
    check_speech_request(model, request, {})
    return request


def audio_message(path: str) -> dict:
    """The chat message that plays ``path`` (Gradio's Chatbot shows an audio file with
    its audio player)."""
    return {"role": "assistant", "content": {"path": path, "mime_type": "audio/wav"}}


def messages_of(reply: Any) -> list[dict]:
    """``ThoughtsAndAnswer.reply()`` as a list of messages."""
    if isinstance(reply, str):
        return [{"role": "assistant", "content": reply}] if reply else []
    return list(reply)


def speaking_box() -> dict:
    return {"role": "assistant", "content": "The answer's audio comes once it is spoken.",
            "metadata": {"title": SPEAKING_TITLE, "status": "pending"}}


def spoken_turn(session: "ChatSession", inputs, options: SamplingOptions,
                request: SpeechRequest, image_hashes: list[str] | None,
                reply: ThoughtsAndAnswer, every: float) -> Iterator[tuple[Any, str]]:
    """Yield ``(reply, stats_markdown)`` as ``session.respond`` does, at least every
    ``every`` seconds: the text as it is written, then the text with its audio and the
    new figures. A failure is raised, ``reply`` holding what was said before it. Closed
    by Gradio (the stop button, the page gone), it cancels the request in the engine.
    ``image_hashes``: the conversation's (None: no prefix reuse), as a text turn's."""
    items: queue.SimpleQueue = queue.SimpleQueue()
    mx.reset_peak_memory()  # here: just before this answer runs
    submitted = time.perf_counter()
    handle = session.engine.submit(inputs, options, items.put, image_hashes=image_hashes,
                                   speech=request)
    last = speech = first_at = written_at = None
    over = False  # the request has ended in the engine (its speech came, or its failure)
    try:
        while not over:
            try:
                item = items.get(timeout=every)
            except queue.Empty:
                item = None
            if isinstance(item, BaseException):
                over = True
                raise item
            if isinstance(item, BatchStep):
                first_at = first_at or time.perf_counter()
                last = item
                reply.feed(item.text)
                if item.finish_reason is not None:
                    reply.finish()
                    written_at = time.perf_counter()
            elif isinstance(item, BatchAudio):  # the chat plays the whole speech at the end
                speech = item.speech
                over = speech is not None
                continue
            shown = messages_of(reply.reply()) + ([speaking_box()] if written_at else [])
            yield shown, session.earlier_stats_markdown()
    finally:
        if not over:  # closed by Gradio: the engine stops it at its next step
            handle.cancel()
    uploads = session.uploads or process_uploads()
    path = uploads.keep_answer_audio(wav_bytes(speech.audio, speech.sample_rate))
    session.last_stats = AnswerStats(
        prompt_tokens=last.prompt_tokens, reused_tokens=last.cached_tokens,
        time_to_first_token=first_at - submitted,
        generation_tokens=last.generation_tokens,
        generation_seconds=written_at - first_at,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        finish_reason=last.finish_reason or "stop",
        audio_seconds=speech.audio_seconds, speech_seconds=speech.seconds, voice=speech.voice)
    yield messages_of(reply.reply()) + [audio_message(path)], session.stats_markdown()
