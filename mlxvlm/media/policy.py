"""Where media may come from and what decoding them may cost: one frozen
:class:`MediaPolicy` that every loader reads its source under, from the caller down to the
bytes (``sources``) and the decoder (``decode_work``), instead of a dozen keyword
arguments passed through each signature.

An image's limits are part of it (a server sets them once for every image it reads), as
are the bounds on a video decoder's work; how many frames to sample and the sound track's
length are their loaders' own arguments, since they describe what is wanted, not what
may be spent. ``names`` says what the caller's entry point calls each option, for the
fixes errors suggest.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxvlm.media.option_names import PYTHON_NAMES, OptionNames

DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_BYTES = 50 * 2**20
# Pillow's own default for Image.MAX_IMAGE_PIXELS (~ a 13k x 13k image).
DEFAULT_MAX_PIXELS = 178_956_970

# What an entry point that decodes strangers' media (the server, the chat UI) lets the
# videos of one request cost; the Python API and the generate CLI, which decode the
# caller's own files, bound nothing by default. Every frame is decoded to sample from it,
# so a video's cost is its frames times their size, whatever is kept: a 10-minute video at
# 30 fps is 18,000 frames; 10 G pixels are ~4,800 1080p frames or ~10,800 720p ones; a
# decoder thread does a few hundred million pixels per CPU second on a slow core.
SERVED_MAX_VIDEO_FRAMES = 18_000
SERVED_MAX_VIDEO_DECODE_PIXELS = 10_000_000_000
SERVED_MAX_DECODE_SECONDS = 30.0


@dataclass(frozen=True)
class MediaPolicy:
    """- ``allow_remote``: if False, http(s) URLs are refused.
    - ``allow_local``: if False, local paths are refused whatever ``allowed_dir`` says
      (for a server that must not read local files at all).
    - ``allowed_dir``: if given, local paths must resolve, after following symlinks,
      inside this directory (the server sets it); None allows any local path.
    - ``public_only``: URLs may only lead (redirects included) to public internet
      addresses, checked after DNS resolution and before connecting; private, loopback
      and link-local targets are refused (the server sets it).
    - ``timeout``: seconds for each network operation and for the whole download.
    - ``max_image_bytes``, ``max_image_pixels``: :func:`~mlxvlm.media.load_image`'s
      ``max_bytes`` and ``max_pixels`` when it is not given them; ``max_image_pixels`` is
      also the largest video frame (``load_video``'s ``max_frame_pixels``).
    - ``max_video_frames``: the most frames a video may hold (each is decoded, whichever
      are kept), from the container before decoding and counted while decoding.
    - ``max_video_decode_pixels``: the pixels of all frames decoded for one request's
      videos (one ``load_video`` call outside a server's request), from the container's
      claims before decoding and counted while decoding.
    - ``max_decode_seconds``: CPU seconds decoding one request's videos and audio; a
      decoder under this bound runs on the caller's thread only, so that all of its work
      is counted.
    - None: no bound. ``names``: what the caller's entry point calls each option.
    """

    allow_remote: bool = True
    allow_local: bool = True
    allowed_dir: str | os.PathLike | None = None
    public_only: bool = False
    timeout: float | None = DEFAULT_TIMEOUT
    max_image_bytes: int = DEFAULT_MAX_BYTES
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    max_video_frames: int | None = None
    max_video_decode_pixels: int | None = None
    max_decode_seconds: float | None = None
    names: OptionNames = PYTHON_NAMES

    @classmethod
    def of(cls, policy: "MediaPolicy | Mapping[str, Any] | None" = None, /,
           **options: Any) -> "MediaPolicy":
        """``policy`` (None: the defaults; a mapping: its fields by name) with ``options``
        replacing fields. A name that is not a field is a ``TypeError`` naming it and the
        fields there are, rather than an option silently ignored."""
        if isinstance(policy, Mapping):
            options = {**policy, **options}
            policy = None
        elif policy is not None and not isinstance(policy, MediaPolicy):
            raise TypeError(f"expected a MediaPolicy or a mapping of its fields, got "
                            f"{type(policy).__name__}")
        unknown = sorted(set(options) - _FIELDS)
        if unknown:
            raise TypeError(f"unknown media option(s) {', '.join(map(repr, unknown))}; a "
                            f"MediaPolicy has {', '.join(sorted(_FIELDS))}")
        base = policy or _DEFAULT
        return dataclasses.replace(base, **options) if options else base

    @classmethod
    def served(cls, **options: Any) -> "MediaPolicy":
        """A policy for strangers' media: the decoding bounds ``SERVED_*`` (``options``
        replace any field)."""
        bounds = dict(max_video_frames=SERVED_MAX_VIDEO_FRAMES,
                      max_video_decode_pixels=SERVED_MAX_VIDEO_DECODE_PIXELS,
                      max_decode_seconds=SERVED_MAX_DECODE_SECONDS)
        return cls(**{**bounds, **options})

    def other_ways(self, besides: str) -> str:
        """``"send the file as a data URL or ..."``: the ways this policy takes a file
        other than ``besides`` (``"remote"``, ``"local"``)."""
        ways = ["a data URL"]
        if self.allow_remote and besides != "remote":
            ways.append("an http(s) URL")
        if self.allow_local and besides != "local":
            ways.append("a local path" + (" inside the allowed folder" if self.allowed_dir
                                          else ""))
        return "send the file as " + " or ".join(ways)

    def refused_fix(self, refused: str) -> str:
        """The fix for a source refused by its kind (``"remote"``, ``"local"``): the
        other ways, and the option that allows this one where the entry point has it."""
        option = getattr(self.names, f"allow_{refused}")
        what = {"remote": "remote URLs", "local": "local files"}[refused]
        fix = self.other_ways(besides=refused)
        return f"{fix}, or allow {what} with {option}" if option else fix


_FIELDS = frozenset(f.name for f in dataclasses.fields(MediaPolicy))
_DEFAULT = MediaPolicy()
