"""What a caller of ``generate`` wants from its media, as one object: how videos are
sampled (``fps``, ``max_frames``, as ``load_video`` takes them) and the policy every
image, video and audio is read under."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxvlm.errors import MlxvlmError
from mlxvlm.media.policy import MediaPolicy


@dataclass(frozen=True)
class MediaOptions:
    fps: float | None = None  # None: load_video's default
    max_frames: int | None = None  # None: load_video's default
    # None: MediaPolicy's defaults; a mapping: its fields (as prepare_inputs takes it).
    media_policy: MediaPolicy | Mapping[str, Any] | None = None

    def validate(self) -> None:
        if self.fps is not None and not self.fps > 0:
            raise MlxvlmError(f"fps must be above 0, got {self.fps}")
        if self.max_frames is not None and self.max_frames < 1:
            raise MlxvlmError(f"max_frames must be at least 1, got {self.max_frames}")

    def video_options(self) -> dict:
        """``prepare_inputs``' ``video_options``: only the values set, so that the
        loader's defaults stay its own."""
        return {k: v for k, v in (("fps", self.fps), ("max_frames", self.max_frames))
                if v is not None}
