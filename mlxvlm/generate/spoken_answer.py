"""An answer written and spoken for a caller that holds the model alone (the thinker's
state tap is model-wide): ``generate``'s own loop under the tap, the talker and the codec
following it token by token (``speech.pipeline.AnswerSpeaker``). The server's spoken answers and the chat UI's share
it; both run it in a job whose cancel flag their client's leaving sets
(``preparation``), and it stops at the next token or codec frame after that."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mlxvlm.generate.cache import CacheOptions
from mlxvlm.generate.loop import fit_to_context
from mlxvlm.generate.speech import SpeechRequest
from mlxvlm.generate.stream import GenerationResult, generate_prepared
from mlxvlm.media.decode_work import check_cancelled
from mlxvlm.prompt import PreparedInputs
from mlxvlm.sampling import SamplingOptions
from mlxvlm.speech.pipeline import Speech


@dataclass
class SpokenAnswer:
    """A written and spoken answer; its counts are named as a batch step's (``usage``)."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str | None
    speech: Speech
    cached_tokens: int = 0  # no prefix reuse: the talker needs the whole prompt's states
    time_to_first_token: float = 0.0  # seconds from the start to the first token
    writing_seconds: float = 0.0  # from the first token to the last

    @property
    def generation_tokens(self) -> int:
        return len(self.tokens)


def write_and_speak(model: Any, processor: Any, inputs: PreparedInputs,
                    options: SamplingOptions, request: SpeechRequest, *,
                    prefill_step_size: int = 2048,
                    on_step: Callable[[GenerationResult], None] | None = None,
                    on_audio: Callable[[np.ndarray], None] | None = None) -> SpokenAnswer:
    """The answer written (``generate``'s loop under the thinker tap) and spoken as it is
    written (the talker follows the thinker); each text step to ``on_step``, each decoded
    chunk of samples to ``on_audio``, in the order they come. Raises
    ``PreparationCancelled`` at the next token or talker frame once the job's client is
    gone (every stage's caches freed)."""
    options.max_tokens = fit_to_context(model, inputs.num_tokens, options.max_tokens)
    start = time.perf_counter()
    texts, tokens, finish_reason, speech = [], [], None, None
    first_at = written = None
    for result in generate_prepared(model, processor, inputs, options, CacheOptions(),
                                    prefill_step_size=prefill_step_size, start=start,
                                    speech=request):
        if result.token is None:  # a chunk of the speech
            check_cancelled("speaking the answer")
            speech = result.speech or speech
            if on_audio is not None and len(result.audio):
                on_audio(result.audio)
            continue
        check_cancelled("writing the answer to speak")
        first_at = first_at or time.perf_counter()
        texts.append(result.text)
        tokens.append(result.token)
        finish_reason = result.finish_reason
        if finish_reason is not None:
            written = time.perf_counter()
        if on_step is not None:
            on_step(result)
    written = written or time.perf_counter()
    first_at = first_at or written
    return SpokenAnswer("".join(texts), tokens, inputs.num_tokens, finish_reason, speech,
                        time_to_first_token=first_at - start, writing_seconds=written - first_at)
