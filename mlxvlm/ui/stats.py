"""The side panel's figures for the last answer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AnswerStats:
    prompt_tokens: int
    reused_tokens: int  # prompt tokens continued from an earlier turn's cache
    time_to_first_token: float  # seconds, from submission (the turn's own wait excluded)
    generation_tokens: int
    generation_seconds: float  # from the first token to the last
    peak_memory_gb: float
    finish_reason: str  # "stop", "length" or "stopped" (by the user)
    # A spoken answer's: the seconds of audio, the talker and codec's seconds, the voice
    audio_seconds: float | None = None
    speech_seconds: float = 0.0
    voice: str | None = None

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens actually computed per second (the reused prefix costs nothing)."""
        computed = self.prompt_tokens - self.reused_tokens
        return computed / self.time_to_first_token if self.time_to_first_token > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        steps = self.generation_tokens - 1  # the first token is the prompt's
        return steps / self.generation_seconds if self.generation_seconds > 0 else 0.0

    def markdown(self) -> str:
        spoken = [] if self.audio_seconds is None else [
            f"| spoken | {self.audio_seconds:.1f} s of audio in {self.speech_seconds:.2f} s "
            f"({self.voice}) |"]
        return "\n".join(
            [
                "| figure | last answer |",
                "| --- | --- |",
                f"| prompt tokens | {self.prompt_tokens} ({self.reused_tokens} reused) |",
                f"| prompt speed | {self.prompt_tps:.1f} tokens/s |",
                f"| time to first token | {self.time_to_first_token:.2f} s |",
                f"| generated | {self.generation_tokens} tokens ({self.finish_reason}) |",
                f"| generation speed | {self.generation_tps:.1f} tokens/s |",
                *spoken,
                f"| peak memory | {self.peak_memory_gb:.3f} GB |",
            ]
        )


NO_ANSWER_YET = "No answer yet."

# Above the figures after a turn that failed: they are not of that turn.
FAILED_TURN = "**The last turn gave no answer.** The figures are of the answer before it."


# Above the figures while a turn is prepared or streamed (or once it was stopped): they
# are the model's previous answer's, perhaps another conversation's, not this one's.
TURN_UNDER_WAY = ("**Figures of the previous answer**; this answer's show when it is "
                  "complete.")


def earlier_markdown(stats: AnswerStats | None) -> str:
    """The panel during a turn: the earlier figures (if any), marked as earlier."""
    if stats is None:
        return NO_ANSWER_YET
    return TURN_UNDER_WAY + "\n\n" + stats.markdown()


def stale_markdown(stats: AnswerStats | None) -> str:
    """The panel after a failed turn: the earlier figures (if any), marked as earlier."""
    if stats is None:
        return "The last turn gave no answer. " + NO_ANSWER_YET
    return FAILED_TURN + "\n\n" + stats.markdown()
