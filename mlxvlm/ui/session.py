"""The model behind the chat: one answer at a time, streamed, stoppable, measured.

The model runs on the server's batching engine (``mlxvlm.batching``) with a batch of one
and a prompt-prefix cache: a follow-up turn continues from the KV cache the previous
turn left, so the shared prefix is not prefilled again and, when the new turn adds only
text, no earlier image is encoded again. A turn is prepared in ``PREPARATION``'s workers
(turns with attachments apart from text-only ones, each stopped when its turn is
closed); answers are serialized by a lock (the engine owns the one model; the page's
other users wait their turn), and ``respond`` is the
generator Gradio's ``ChatInterface`` streams from: when Gradio closes it (the stop
button), the request is cancelled and the engine stops computing it at its next step.
A model that speaks answers aloud through the same engine (``spoken_answers``); a spoken
turn reuses an earlier spoken turn's prefix (its entry keeps the thinker states the
talker reads), not a text turn's.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import gradio as gr
import mlx.core as mx

from mlxvlm.batching import BatchEngine, BatchStep, SamplingOptions
from mlxvlm.errors import MlxvlmError
from mlxvlm.media import MediaPolicy
from mlxvlm.batching.prefix_cache import PrefixCache
from mlxvlm.preparation import PreparationPools
from mlxvlm.prompt import prepare_inputs
from mlxvlm.speech.duration import DEFAULT_MAX_SPEECH_SECONDS
from mlxvlm.ui.conversation import NOTICE_TITLE, attachment_paths, build_conversation
from mlxvlm.ui.media_kinds import supported_kinds
from mlxvlm.ui.spoken_answers import (SpeechSettings, messages_of, speaks, speech_request,
                                      spoken_turn, voices)
from mlxvlm.ui.stats import NO_ANSWER_YET, AnswerStats, earlier_markdown, stale_markdown
from mlxvlm.ui.thoughts import ThoughtsAndAnswer, kept_token_ids, template_thinks
from mlxvlm.ui.uploads import Uploads

log = logging.getLogger(__name__)

# How often a waiting ``respond`` yields (nothing new): Gradio can only close a generator
# between two items, so this bounds how long a stop waits during a queue wait or a prefill.
YIELD_EVERY_S = 0.25
# Turns are prepared (conversation, media decoding, processor) off Gradio's threads, by
# every model's sessions together: at most two turns with attachments at a time, and
# text-only turns on workers of their own, so that no conversation's video holds up
# another's text chat.
PREPARATION = PreparationPools(2, 2, name="mlxvlm-ui-prepare")


@dataclass
class Settings:
    """The side controls, as the chat function receives them."""

    system: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256
    repetition_penalty: float = 1.0
    seed: int | None = None

    @classmethod
    def from_controls(
        cls, system, temperature, top_p, max_tokens, repetition_penalty, seed
    ) -> "Settings":
        return cls(
            system=(system or "").strip() or None,
            temperature=float(temperature if temperature is not None else 0.0),
            top_p=float(top_p if top_p is not None else 1.0),
            max_tokens=int(max_tokens if max_tokens is not None else 256),
            repetition_penalty=float(repetition_penalty or 1.0),
            seed=None if seed is None or seed == "" or int(seed) < 0 else int(seed),
        )

    def sampling_options(self) -> SamplingOptions:
        return SamplingOptions(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            repetition_penalty=(
                None if self.repetition_penalty == 1.0 else self.repetition_penalty
            ),
            seed=self.seed,
        )


def notice(text: str) -> dict:
    """A chat message from the app, not the model (see ``conversation.NOTICE_TITLE``)."""
    return {"role": "assistant", "content": text, "metadata": {"title": NOTICE_TITLE}}


def _readable(error: BaseException) -> str:
    if isinstance(error, MlxvlmError):
        return str(error)
    log.error("generation failed", exc_info=error)
    return f"internal error ({type(error).__name__}: {error}); the app keeps running"


def _placeholder_texts(model: Any, processor: Any) -> tuple[str, ...]:
    """The strings of the model's media placeholder tokens."""
    tokenizer = processor.tokenizer
    tokens = tokenizer.convert_ids_to_tokens(sorted(model.placeholder_token_ids))
    return tuple(t for t in tokens if t)


class ChatSession:
    """Answers chat turns with one loaded model."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        model_name: str,
        *,
        prefix_cache: PrefixCache | None = None,
        media_options: MediaPolicy | None = None,
        uploads: Uploads | None = None,
        max_speech_seconds: float = DEFAULT_MAX_SPEECH_SECONDS,
    ):
        self.model = model
        self.processor = processor
        self.model_name = model_name
        self.kinds = supported_kinds(model, processor)
        self.placeholders = _placeholder_texts(model, processor)
        self.thinks = template_thinks(processor)
        self.kept_token_ids = kept_token_ids(processor, self.thinks)
        self.media_options = media_options
        # A model that speaks (Qwen3-Omni with its talker) answers aloud too, each spoken
        # answer at most this long (the session's answers come one at a time).
        self.speaks = speaks(model)
        self.voices, self.default_voice = voices(model)
        self.max_speech_seconds = max_speech_seconds
        # Set by the page (``app.build_app``): then only files uploaded in the conversation
        # are read.
        self.uploads = uploads
        self.engine = BatchEngine(
            model,
            processor,
            max_batch_size=1,
            prefix_cache=prefix_cache if prefix_cache is not None else PrefixCache(),
        )
        self.last_stats: AnswerStats | None = None
        self._turn = threading.Lock()

    def start(self) -> "ChatSession":
        """Start the engine's thread (the model may have been loaded on another one:
        tests/test_threads.py keeps every family free of thread-bound lazy constants)."""
        self.engine.start()
        return self

    def close(self) -> None:
        self.engine.close()

    @property
    def model_type(self) -> str:
        return type(self.model).__module__.rsplit(".", 1)[-1]

    @property
    def max_context(self) -> int | None:
        return self.model.max_context

    def stats_markdown(self) -> str:
        return self.last_stats.markdown() if self.last_stats else NO_ANSWER_YET

    def earlier_stats_markdown(self) -> str:
        """The panel while a turn is under way: the earlier figures, marked."""
        return earlier_markdown(self.last_stats)

    def failed_stats_markdown(self) -> str:
        """The panel after a turn that gave no answer: the earlier figures, marked."""
        return stale_markdown(self.last_stats)

    def _check_attachments(self, message, history, request) -> None:
        """Refuse (``AttachmentRefused``) any file the conversation did not upload."""
        if self.uploads is not None:
            self.uploads.admit(getattr(request, "session_hash", None), message, history)

    def respond(
        self,
        message: dict | str,
        history: list[dict],
        system: str | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_tokens: int = 256,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        speak: bool = True,
        voice: str | None = None,
        talker_temperature: float | None = None,
        request: gr.Request = None,
    ) -> Iterator[tuple[Any, str]]:
        """Yield ``(reply, stats_markdown)``: the answer so far (``[]`` while there is
        none yet), then the final answer with the new statistics; a problem becomes a
        notice in the chat instead, with the earlier statistics marked as such.

        A model that speaks answers aloud too unless ``speak`` is false (in ``voice``,
        None: its default; ``talker_temperature`` None: its own sampling): the final
        reply ends with the audio's message (``spoken_answers``). The speech settings
        are ignored for a model that does not speak.

        ``request``: given by Gradio (by the annotation); its session is the conversation
        whose uploads it may read. A file it did not upload raises ``AttachmentRefused``,
        which Gradio answers with a bare error, as it does its own refusals."""
        self._check_attachments(message, history, request)
        new, earlier = attachment_paths(history, message)
        job = PREPARATION.submit(
            functools.partial(self._prepare, message, history, system, temperature, top_p,
                              max_tokens, repetition_penalty, seed,
                              SpeechSettings.from_controls(speak, voice, talker_temperature)),
            media=bool(new or earlier))
        try:
            while True:
                try:
                    settings, conversation, inputs, spoken = job.future.result(
                        timeout=YIELD_EVERY_S)
                    break
                except TimeoutError:
                    yield [], self.earlier_stats_markdown()
        except (MlxvlmError, ValueError, TypeError) as e:
            yield notice(_readable(e)), self.failed_stats_markdown()
            return
        finally:
            if not job.future.done():  # closed by Gradio (stop button, page gone)
                job.stop()

        while not self._turn.acquire(timeout=YIELD_EVERY_S):
            yield [], self.earlier_stats_markdown()
        try:
            reply = ThoughtsAndAnswer(self.thinks, inputs.prompt_text)
            if spoken is not None:
                yield from self._answer_aloud(inputs, settings, spoken,
                                              conversation.image_hashes, reply)
            else:
                yield from self._answer(inputs, settings, conversation.image_hashes, reply)
        finally:
            self._turn.release()

    def _prepare(self, message, history, system, temperature, top_p, max_tokens,
                 repetition_penalty, seed, speech: SpeechSettings):
        """The turn's settings, conversation, model inputs and what the talker is asked
        for (None: a written answer only), in a preparation worker: media decoding stops
        there when the turn is closed."""
        settings = Settings.from_controls(
            system, temperature, top_p, max_tokens, repetition_penalty, seed
        )
        spoken = None
        if self.speaks and speech.speak:  # an unknown voice refused before any work
            spoken = speech_request(self.model, speech, self.max_speech_seconds)
        conversation = build_conversation(
            history, message, self.kinds, self.media_options, self.placeholders
        )
        inputs = prepare_inputs(
            self.processor,
            conversation.messages,
            system=settings.system,
            feature_names=getattr(self.model, "feature_names", None),
            media_policy=self.media_options,
            max_context=self.model.max_context,
        )
        # MLX evaluates a graph only on the thread that built it: the engine's thread
        # must get concrete arrays.
        mx.eval(inputs.input_ids, list(inputs.features.values()))
        return settings, conversation, inputs, spoken

    def _answer_aloud(self, inputs, settings: Settings, spoken, image_hashes,
                      reply: ThoughtsAndAnswer) -> Iterator[tuple[Any, str]]:
        """A spoken answer (``spoken_answers``), a failure shown after what was said."""
        options = settings.sampling_options()
        options.kept_token_ids = self.kept_token_ids
        try:
            yield from spoken_turn(self, inputs, options, spoken, image_hashes, reply,
                                   YIELD_EVERY_S)
        except Exception as e:  # noqa: BLE001 -- the chat shows it; the app goes on
            reply.finish()
            yield [*messages_of(reply.reply()), notice(_readable(e))], \
                self.failed_stats_markdown()

    def _answer(
        self, inputs, settings: Settings, image_hashes, reply: ThoughtsAndAnswer
    ) -> Iterator[tuple[Any, str]]:
        steps: queue.SimpleQueue[BatchStep | BaseException] = queue.SimpleQueue()
        mx.reset_peak_memory()
        submitted = time.perf_counter()
        try:
            options = settings.sampling_options()
            options.kept_token_ids = self.kept_token_ids  # the thinking markers, to split on
            handle = self.engine.submit(inputs, options, steps.put, image_hashes=image_hashes)
        except MlxvlmError as e:
            yield notice(_readable(e)), self.failed_stats_markdown()
            return

        first_at, finished = None, False
        try:
            while True:
                try:
                    step = steps.get(timeout=YIELD_EVERY_S)
                except queue.Empty:
                    yield reply.reply(), self.earlier_stats_markdown()
                    continue
                if isinstance(step, BaseException):
                    finished = True
                    reply.finish()
                    said = reply.reply()  # keep what was said before the failure
                    said = [{"role": "assistant", "content": said}] if isinstance(said, str) \
                        else said
                    yield [*said, notice(_readable(step))], self.failed_stats_markdown()
                    return
                now = time.perf_counter()
                first_at = first_at or now
                if step.finish_reason is None:
                    if step.text:
                        reply.feed(step.text)
                        yield reply.reply(), self.earlier_stats_markdown()
                    continue
                finished = True
                reply.feed(step.text)
                reply.finish()
                self.last_stats = AnswerStats(
                    prompt_tokens=step.prompt_tokens,
                    reused_tokens=step.cached_tokens,
                    time_to_first_token=first_at - submitted,
                    generation_tokens=step.generation_tokens,
                    generation_seconds=now - first_at,
                    peak_memory_gb=mx.get_peak_memory() / 1e9,
                    finish_reason=step.finish_reason,
                )
                yield reply.reply(), self.stats_markdown()
                return
        finally:
            if not finished:
                # Closed by Gradio (stop button, page gone): stop computing this answer.
                handle.cancel()
