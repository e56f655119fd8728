"""What each media option is called where a user sets it, so that an error's fix names
the option of the entry point the input came from: ``--allow-remote-media`` on the
server, ``allow_remote=True`` in Python, nothing where the entry point has no such
option (the chat UI, the generate command line)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class OptionNames:
    """Each field: the option's name at one entry point, or None where it has none (the
    fix then names no option). Python's names are the defaults: ``MediaPolicy`` fields
    (which every loader also takes as a keyword) and the loaders' own arguments."""

    allow_remote: str | None = "allow_remote=True"
    allow_local: str | None = "allow_local=True"
    timeout: str | None = "timeout"
    max_image_bytes: str | None = "max_image_bytes"
    max_image_pixels: str | None = "max_image_pixels"
    max_video_frames: str | None = "max_video_frames"
    max_video_decode_pixels: str | None = "max_video_decode_pixels"
    max_decode_seconds: str | None = "max_decode_seconds"
    # load_video's and load_audio's own arguments
    max_bytes: str | None = "max_bytes"
    max_audio_seconds: str | None = "max_seconds"

    def raise_fix(self, option: str, what: str = "") -> str:
        """``"; or raise NAME"``-style tail for a limit's fix: ``", or raise NAME"`` plus
        ``what`` (e.g. " if you trust the source"), or "" where the option has no name."""
        name = getattr(self, option)
        return f", or raise {name}{what}" if name else ""


PYTHON_NAMES = OptionNames()
# An entry point with no media options of its own (the generate CLI, the chat UI).
NO_NAMES = OptionNames(**{f.name: None for f in dataclasses.fields(OptionNames)})
