"""Where media may come from: one frozen :class:`MediaPolicy` that every loader reads its
source under, from the caller down to the bytes (``sources``), instead of five keyword
arguments passed through each signature.

An image's limits are part of it (a server sets them once for every image it reads); a
video's and an audio's are their loaders' own arguments, since they differ by kind.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_BYTES = 50 * 2**20
# Pillow's own default for Image.MAX_IMAGE_PIXELS (~ a 13k x 13k image).
DEFAULT_MAX_PIXELS = 178_956_970


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
      ``max_bytes`` and ``max_pixels`` when it is not given them.
    """

    allow_remote: bool = True
    allow_local: bool = True
    allowed_dir: str | os.PathLike | None = None
    public_only: bool = False
    timeout: float | None = DEFAULT_TIMEOUT
    max_image_bytes: int = DEFAULT_MAX_BYTES
    max_image_pixels: int = DEFAULT_MAX_PIXELS

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


_FIELDS = frozenset(f.name for f in dataclasses.fields(MediaPolicy))
_DEFAULT = MediaPolicy()
