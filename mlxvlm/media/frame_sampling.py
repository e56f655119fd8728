"""Which frames of a video a family's model sees: each family's transformers video
processor picks them its own way, and mlxvlm picks the same ones.

The hook: a family's video processor (``processor.video_processor``) names its way in a
``frame_sampling`` attribute -- a key of :data:`SAMPLERS` -- and carries that way's
settings as attributes under transformers' names (``fps``, ``num_frames``,
``min_frames``, ``max_frames``, ``temporal_patch_size``, ``skip_secs``).
:func:`sampler_for` builds the :class:`FrameSampler` from them, and ``prepare_inputs``
hands it to ``load_video(..., sampler=...)``. A processor that names none gets the even
spread of :class:`FrameSampler`.

A sampler answers one question -- the indices of the frames to keep, in time order, of a
video of ``total_frames`` frames at ``source_fps`` -- asked either at a rate (``fps``
frames per second of video) or by count (``num_frames``). Each sampler's docstring names
the transformers function it follows; its fields are the settings that function reads
from the video processor (the checkpoint's config can set them).

Where transformers would refuse a video (more frames asked than it has, none at all),
a sampler keeps every frame, or the first, instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

# When neither the caller nor the family says how to sample (transformers' processors
# that sample nothing then take every frame), frames are taken at this rate.
FALLBACK_FPS = 2.0


@dataclass(frozen=True)
class FrameSampler:
    """Frames spread evenly from the first to the last, ``fps`` per second of video
    (rounded), or ``num_frames`` of them -- qwen-vl-utils' way, and mlxvlm's for a model
    that does not declare its own. ``fps`` / ``num_frames``: the family's defaults, used
    when the caller passes neither (``num_frames`` wins where both are set)."""

    fps: float | None = None
    num_frames: int | None = None

    def indices(self, total_frames: int, source_fps: float, *, fps: float | None = None,
                num_frames: int | None = None) -> np.ndarray:
        """The kept frames' indices (sorted, unique) in ``0 .. total_frames - 1``."""
        if total_frames < 1:
            raise ValueError("a video has at least one frame")
        if fps is None and num_frames is None:
            fps, num_frames = self.fps, self.num_frames
            if fps is None and num_frames is None:
                fps = FALLBACK_FPS
        picked = self.pick(total_frames, float(source_fps), fps, num_frames)
        picked = np.unique(np.clip(np.asarray(picked, dtype=np.int64), 0, total_frames - 1))
        return picked if picked.size else np.zeros(1, np.int64)

    def pick(self, total: int, source_fps: float, fps: float | None,
             num_frames: int | None) -> np.ndarray:
        if num_frames is None:
            num_frames = round(total / source_fps * fps)
        return _spread(total, max(1, min(num_frames, total)))


def _spread(total: int, count: int) -> np.ndarray:
    """``count`` frames from the first to the last, rounded to the nearest."""
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def _step(total: int, count: int) -> np.ndarray:
    """``count`` frames one even step apart from the first (``i * total // count``)."""
    return np.arange(count, dtype=np.int64) * total // count


@dataclass(frozen=True)
class StepSampler(FrameSampler):
    """transformers' ``BaseVideoProcessor.sample_frames`` (``default_sample_indices_fn``):
    ``int(seconds * fps)`` frames (at least one), or ``num_frames``, one even step apart
    from the first frame. ``num_frames`` (the call's or the family's) wins over ``fps``,
    as there. LLaVA-OneVision, Gemma 4."""

    def indices(self, total_frames, source_fps, *, fps=None, num_frames=None):
        # transformers reads the processor's num_frames whenever the call gives none.
        if num_frames is None and self.num_frames is not None:
            num_frames = self.num_frames
        return super().indices(total_frames, source_fps, fps=fps, num_frames=num_frames)

    def pick(self, total, source_fps, fps, num_frames):
        if num_frames is None:
            num_frames = max(1, int(total / source_fps * fps))
        return _step(total, min(num_frames, total))


@dataclass(frozen=True)
class QwenStepSampler(FrameSampler):
    """transformers' ``Qwen2VLVideoProcessor.sample_frames``: ``seconds * fps`` frames,
    at least ``min_frames`` and at most ``max_frames`` (both within the video), rounded
    down to a multiple of ``temporal_patch_size``; or ``num_frames`` rounded to one. They
    are taken one even step (``total / count``) apart from the first frame, truncated.
    Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni."""

    min_frames: int = 4
    max_frames: int = 768
    temporal_patch_size: int = 2

    def pick(self, total, source_fps, fps, num_frames):
        tps = self.temporal_patch_size
        if num_frames is not None:
            count = round(num_frames / tps) * tps
        else:
            most = math.floor(min(self.max_frames, total) / tps) * tps
            count = min(max(total / source_fps * fps, self.min_frames), most, total)
            count = math.floor(count / tps) * tps
        count = min(count, total)
        if count < 1:  # shorter than one temporal patch: transformers cannot sample it
            return np.arange(total)
        # torch.arange(0, total, total / count).int(): the length and the values worked
        # out in double precision, the values then stored as float32 and truncated
        step = total / count
        length = math.ceil(total / step)
        return (np.arange(length) * step).astype(np.float32).astype(np.int64)


@dataclass(frozen=True)
class SpreadSampler(FrameSampler):
    """transformers' ``Qwen3VLVideoProcessor.sample_frames``: ``int(seconds * fps)``
    frames (or ``num_frames``), at least ``min_frames``, at most ``max_frames`` and the
    video's, spread from the first to the last frame (rounded). Qwen3-VL."""

    fps: float | None = 2.0
    min_frames: int = 4
    max_frames: int = 768

    def pick(self, total, source_fps, fps, num_frames):
        if num_frames is None:
            num_frames = min(max(int(total / source_fps * fps), self.min_frames),
                             self.max_frames, total)
        return _spread(total, max(1, num_frames))


@dataclass(frozen=True)
class SmolVLMSampler(FrameSampler):
    """transformers' ``SmolVLMVideoProcessor.sample_frames``: ``round(seconds * fps)``
    frames, at most ``num_frames`` (the checkpoint's ``video_sampling.max_frames``),
    spread (truncated) from the first to the last frame -- or, when the video is longer
    than ``2 * skip_secs`` plus ``num_frames * fps`` seconds, from ``skip_secs`` in to
    ``skip_secs`` before the end. SmolVLM2."""

    fps: float | None = 1.0
    num_frames: int | None = 64
    skip_secs: float = 1.0

    def indices(self, total_frames, source_fps, *, fps=None, num_frames=None):
        # Both settings always apply there: the call's, else the processor's.
        fps = self.fps if fps is None else fps
        num_frames = self.num_frames if num_frames is None else num_frames
        return super().indices(total_frames, source_fps, fps=fps, num_frames=num_frames)

    def pick(self, total, source_fps, fps, num_frames):
        duration = total / source_fps
        count = max(1, min(int(round(fps * duration)), num_frames))
        start, end = 0, total - 1
        if self.skip_secs > 0 and duration - 2 * self.skip_secs > num_frames * fps:
            start = int(self.skip_secs * source_fps)
            end = min(int(total - self.skip_secs * source_fps), total - 1)
        if start >= end:
            start, end = 0, total - 1
        return np.linspace(start, end, count, dtype=int)


@dataclass(frozen=True)
class GlmDynamicSampler(FrameSampler):
    """transformers' ``Glm46VVideoProcessor.sample_frames``: a rate chosen by the
    video's length (3 frames a second up to 30 s, 1 up to 300 s, then 0.5; at most 2400 s
    and 640 frames) times ``temporal_patch_size``, frames stepped at that rate from the
    first up to the last whole second; too few (or too many) are spread evenly (truncated)
    instead. The processor reads neither a call's ``fps`` nor ``num_frames``. GLM-4.6V,
    GLM-4.6V-Flash. (Its last frame repeated to an even count there is the video
    processor's padding to whole temporal patches here.)"""

    temporal_patch_size: int = 2

    def indices(self, total_frames, source_fps, *, fps=None, num_frames=None):
        return super().indices(total_frames, source_fps, fps=0.0)

    def pick(self, total, source_fps, fps, num_frames):
        duration = total / source_fps
        effective = min(duration, 2400)
        rate = 3 if effective <= 30 else 1 if effective <= 300 else 0.5
        count = min(int(effective * rate * self.temporal_patch_size), 640)
        step = 1 / source_fps  # as there: timestamps i * (1 / fps), in Python floats
        picked: list[int] = []
        if total >= count:
            second, last_second = 0.0, int(duration)
            advance = 1 / (self.temporal_patch_size * rate)
            for index in range(total):
                if index * step >= second:
                    second += advance
                    picked.append(index)
                    if second >= last_second:
                        break
        if len(picked) < count:
            start, end = (picked[0], picked[-1]) if picked else (0, max(total - 1, 0))
            return np.linspace(start, end, count, dtype=int)
        if len(picked) > count:
            return np.linspace(0, total - 1, count, dtype=int)
        return np.asarray(picked, dtype=np.int64)


@dataclass(frozen=True)
class GlmFpsSampler(FrameSampler):
    """transformers' ``Glm4vVideoProcessor.sample_frames``: ``floor(seconds * fps)``
    frames (at least one), frame ``ceil(i * source_fps / fps)`` for the i-th; a video
    longer than ``max_duration`` seconds gets ``max_duration * fps`` frames spread over
    it (every frame where that is all of them). The call's ``fps`` wins over the
    processor's; ``num_frames`` is not read. GLM-4.1V, GLM-4.5V."""

    fps: float | None = 2.0
    max_duration: float = 300

    def indices(self, total_frames, source_fps, *, fps=None, num_frames=None):
        return super().indices(total_frames, source_fps, fps=self.fps if fps is None else fps)

    def pick(self, total, source_fps, fps, num_frames):
        last = total - 1
        duration = total / source_fps
        if duration <= self.max_duration:
            count = max(math.floor(duration * fps), 1)
            return [min(last, math.ceil(i * source_fps / fps)) for i in range(count)]
        count = int(self.max_duration * fps)
        if count >= total:
            return np.arange(total)
        seconds = np.linspace(0, duration, count, endpoint=True)
        return [min(last, math.ceil(t * source_fps)) for t in seconds]


@dataclass(frozen=True)
class ShiftedStepSampler(FrameSampler):
    """transformers' ``InternVLVideoProcessor.sample_frames``: ``num_frames`` frames (the
    call's, else the processor's; from ``int(seconds * fps)`` when only a rate is
    given), one even step (``total / count``) apart, the first ``initial_shift`` frames
    in -- with ``initial_shift`` True, half a step, so that each frame is the middle of
    its stretch of video. InternVL."""

    initial_shift: bool | float = True

    def indices(self, total_frames, source_fps, *, fps=None, num_frames=None):
        if num_frames is None and fps is None and self.num_frames is not None:
            num_frames = self.num_frames
        return super().indices(total_frames, source_fps, fps=fps, num_frames=num_frames)

    def pick(self, total, source_fps, fps, num_frames):
        if num_frames is None:
            num_frames = int(total / source_fps * fps)
        if not 1 <= num_frames <= total:  # transformers refuses; every frame instead
            return np.arange(total)
        step = total / num_frames
        shift = step / 2 if self.initial_shift is True else float(self.initial_shift or 0)
        # torch.arange(shift, total, step).int(): the length and the values worked out in
        # double precision, the values then stored as float32 and truncated
        length = math.ceil((total - shift) / step)
        return (shift + np.arange(length) * step).astype(np.float32).astype(np.int64)


@dataclass(frozen=True)
class SecondSampler(FrameSampler):
    """transformers' ``MiniCPMV4_6VideoProcessor.sample_frames`` (without stacked
    sub-frames): the frame at the start of every second begun (``int(i * source_fps)``);
    a video longer than ``max_num_frames`` seconds: a frame every tenth of a second,
    ``max_num_frames`` of those spread (truncated) over them. The processor reads neither
    a call's ``fps`` nor ``num_frames``; here ``num_frames`` (``load_video``'s
    ``max_frames`` cap) keeps at most that many of those frames, spread (truncated).
    MiniCPM-V 4.6, MiniCPM-OCR."""

    max_num_frames: int = 128

    def indices(self, total_frames, source_fps, *, fps=None, num_frames=None):
        picked = super().indices(total_frames, source_fps, fps=0.0)
        if num_frames is not None and num_frames < picked.size:
            picked = picked[np.linspace(0, picked.size - 1, max(num_frames, 1), dtype=int)]
        return picked

    def pick(self, total, source_fps, fps, num_frames):
        duration = total / source_fps
        if duration <= self.max_num_frames:
            return [int(i * source_fps) for i in range(math.ceil(duration))]
        stamps = [round(i * 0.1, 1) for i in range(int(duration / 0.1))]
        picked = [min(int(t * source_fps), total - 1) for t in stamps]
        if len(picked) > self.max_num_frames:
            keep = np.linspace(0, len(picked) - 1, self.max_num_frames, dtype=int)
            picked = [picked[i] for i in keep]
        return picked


# The ways a family's video processor may name in its ``frame_sampling`` attribute.
SAMPLERS: dict[str, type[FrameSampler]] = {
    "spread": FrameSampler,
    "step": StepSampler,
    "qwen2_vl": QwenStepSampler,
    "qwen3_vl": SpreadSampler,
    "smolvlm": SmolVLMSampler,
    "glm46v": GlmDynamicSampler,
    "glm4v": GlmFpsSampler,
    "internvl": ShiftedStepSampler,
    "minicpmv": SecondSampler,
}


def sampler_for(video_processor) -> FrameSampler:
    """The sampler ``video_processor`` declares (see the module docstring), its fields
    set from the processor's attributes of the same names where they are not None."""
    way = getattr(video_processor, "frame_sampling", None) or "spread"
    if way not in SAMPLERS:
        raise ValueError(f"unknown frame sampling {way!r}; one of {sorted(SAMPLERS)}")
    cls = SAMPLERS[way]
    settings = {}
    for field in fields(cls):
        value = getattr(video_processor, field.name, None)
        if value is not None:
            settings[field.name] = value
    return cls(**settings)
