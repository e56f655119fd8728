"""Errors a user can act on. The CLIs print these as one line and exit with code 2."""


class MlxvlmError(Exception):
    """Base class of every error caused by the user's input rather than by a bug."""


class ModelNotFoundError(MlxvlmError):
    """The model path or Hub repo could not be found or fetched."""


class CheckpointError(MlxvlmError):
    """The checkpoint's files are missing, inconsistent or do not match the model."""


class PromptTooLongError(MlxvlmError):
    """The prompt does not fit in the model's context (or in the KV-cache window)."""

    limit = "context_length"  # what a server counts the refusal under

    @classmethod
    def of_tokens(cls, tokens: int, context: int, at_least: bool = False) -> "PromptTooLongError":
        """The refusal of a prompt of ``tokens`` tokens (``at_least``: counted only as far
        as needed) for a model of ``context``."""
        length = f"at least {tokens}" if at_least else str(tokens)
        return cls(
            f"the prompt is {length} tokens long but the model's context is {context} "
            "tokens; shorten the prompt or use fewer/smaller images, shorter videos or "
            "shorter audio")


def bounded(text: str, limit: int = 200) -> str:
    """``text`` for a log line or an error message: its first line, at most ``limit``
    characters, and how much was left out (a grammar or a parser's state dump can run to
    megabytes, and a client could make every failure write them again)."""
    first = text.split("\n", 1)[0]
    shown = first[:limit]
    left_out = len(text) - len(shown)
    return f"{shown} [... {left_out:,} more characters]" if left_out else shown
