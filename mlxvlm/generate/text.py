"""A sequence's tokens as text, when it ends, and the whole answer folded from its steps:
shared by ``stream_generate``/``generate`` and the batching engine/``batch_generate``, so
that both end a sequence by the same rules and report it the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from mlxvlm.text.tokenization import processor_state


class StopStrings:
    """Cuts the stream at the first stop string, holding back text that may begin one."""

    def __init__(self, stops: Iterable[str] | None):
        self.stops = [s for s in (stops or []) if s]
        self.held = ""
        self.matched: str | None = None  # the stop string that cut the stream

    def push(self, segment: str) -> tuple[str, bool]:
        text = self.held + segment
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return text[:at], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        self.held = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def _as_stop_list(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class SequenceText:
    """One sequence's generated tokens as text, and the reason it ends.

    ``add(token)`` returns the new text segment (empty while a multi-byte character or a
    possible stop string is pending) and ``"stop"`` (an end-of-sequence id or a stop
    string), ``"length"`` (``max_tokens`` reached) or None. ``kept_token_ids``: special
    tokens whose text stays in (the detokenizer drops special tokens otherwise).
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: set[int],
        stop: str | Sequence[str] | None,
        max_tokens: int,
        kept_token_ids: Iterable[int] = (),
    ):
        self.detokenizer = tokenizer.detokenizer  # a fresh copy per sequence
        self.detokenizer.reset()
        if kept_token_ids:
            self.detokenizer.keep_tokens(kept_token_ids)
        self.eos_token_ids = eos_token_ids
        self.stops = StopStrings(_as_stop_list(stop))
        self.max_tokens = max_tokens
        self.num_tokens = 0

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the sequence, if one did."""
        return self.stops.matched

    def add(self, token: int) -> tuple[str, str | None]:
        self.num_tokens += 1
        finish_reason = None
        if token in self.eos_token_ids:
            finish_reason = "stop"
        else:
            self.detokenizer.add_token(token)
            if self.num_tokens >= self.max_tokens:
                finish_reason = "length"
        if finish_reason is not None:
            self.detokenizer.finalize()
        segment, hit_stop = self.stops.push(self.detokenizer.last_segment)
        if hit_stop:
            finish_reason = "stop"
        elif finish_reason is not None:
            segment += self.stops.flush()
        return segment, finish_reason


def eos_token_ids(processor: Any) -> set[int]:
    """Every end-of-sequence id (config.json, generation_config.json and tokenizer)."""
    return set(processor_state(processor).eos_token_ids)


@dataclass
class GenerationOutput:
    """What ``generate`` (and ``batch_generate``, per prompt) returns: the whole text
    plus the final statistics; with ``top_logprobs``, each token's log-probability and
    its most likely alternatives."""

    text: str
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    peak_memory: float = 0.0
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With audio_output (generate): the answer spoken, float32 mono, at sample_rate; the
    # talker's codes (frames, code groups); the voice; seconds from the call's start to
    # the first decoded audio, and the talker and codec's own seconds.
    audio: Any = None
    sample_rate: int | None = None
    audio_codes: Any = None
    voice: str | None = None
    time_to_first_audio: float | None = None
    speech_seconds: float | None = None


class OutputFolder:
    """Folds the steps of one sequence (``GenerationResult`` or ``BatchStep``: each has
    ``text``, ``token``, ``prompt_tokens``, ``generation_tokens``, ``finish_reason``,
    ``logprob`` and ``top_logprobs``) into its ``GenerationOutput``."""

    def __init__(self):
        self.output = GenerationOutput(text="")
        self.pieces: list[str] = []

    def add(self, step: Any) -> None:
        output = self.output
        self.pieces.append(step.text)
        output.tokens.append(step.token)
        output.prompt_tokens = step.prompt_tokens
        output.generation_tokens = step.generation_tokens
        output.finish_reason = step.finish_reason
        if step.logprob is not None:
            output.logprobs.append(step.logprob)
            if step.top_logprobs is not None:
                output.top_logprobs.append(step.top_logprobs)

    def result(self) -> GenerationOutput:
        self.output.text = "".join(self.pieces)
        return self.output
