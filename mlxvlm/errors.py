"""Errors a user can act on. The CLIs print these as one line and exit with code 2."""


class MlxvlmError(Exception):
    """Base class of every error caused by the user's input rather than by a bug."""


class ModelNotFoundError(MlxvlmError):
    """The model path or Hub repo could not be found or fetched."""


class CheckpointError(MlxvlmError):
    """The checkpoint's files are missing, inconsistent or do not match the model."""


class PromptTooLongError(MlxvlmError):
    """The prompt does not fit in the model's context (or in the KV-cache window)."""
