"""Frame sampling: each family's sampler (mlxvlm.media.frame_sampling) keeps the frames
its transformers video processor's own ``sample_frames`` keeps, asked on the same
metadata at the same fps or frame count; and the hook from a family's video processor
to ``load_video``."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from av_media import coloured_frames, write_video
from mlxvlm.media import load_video
from mlxvlm.media.frame_sampling import (
    SAMPLERS,
    FrameSampler,
    QwenStepSampler,
    SecondSampler,
    ShiftedStepSampler,
    SmolVLMSampler,
    SpreadSampler,
    StepSampler,
    sampler_for,
)

pytest.importorskip("torch")  # Qwen2-VL's sample_frames computes with torch
from transformers.models.internvl.video_processing_internvl import (  # noqa: E402
    InternVLVideoProcessor,
)
from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import (  # noqa: E402
    MiniCPMV4_6VideoProcessor,
)
from transformers.models.llava_onevision.video_processing_llava_onevision import (  # noqa: E402
    LlavaOnevisionVideoProcessor,
)
from transformers.models.qwen2_vl.video_processing_qwen2_vl import (  # noqa: E402
    Qwen2VLVideoProcessor,
)
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (  # noqa: E402
    Qwen3VLVideoProcessor,
)
from transformers.models.smolvlm.video_processing_smolvlm import (  # noqa: E402
    SmolVLMVideoProcessor,
)
from transformers.video_utils import VideoMetadata  # noqa: E402

# (frames, source fps): short, odd, long, one-frame and fractional-rate videos
VIDEOS = [(16, 8.0), (30, 10.0), (1, 25.0), (3, 30.0), (7, 24.0), (101, 29.97), (250, 25.0),
          (900, 30.0), (2000, 23.976), (12, 6.0), (57, 12.5)]
RATES = [0.5, 1.0, 2.0, 3.0, 4.0]


def transformers_indices(processor_class, settings: dict, total: int, source_fps: float,
                         **ask) -> list[int] | None:
    """``processor_class.sample_frames`` on a stand-in instance holding the class's
    settings (updated by ``settings``): transformers' own code, without torchvision.
    None where transformers refuses the video."""
    names = ("fps", "num_frames", "min_frames", "max_frames", "temporal_patch_size",
             "initial_shift", "max_num_frames", "stack_frames")
    stand_in = SimpleNamespace(**{n: getattr(processor_class, n, None) for n in names})
    for name, value in settings.items():
        setattr(stand_in, name, value)
    metadata = VideoMetadata(total_num_frames=total, fps=source_fps, duration=total / source_fps)
    try:
        indices = processor_class.sample_frames(stand_in, metadata, **ask)
    except (ValueError, ZeroDivisionError):
        return None
    return np.asarray(indices).astype(np.int64).tolist()


FAMILIES = {  # the way each family declares, and its transformers processor
    "qwen2_vl": (QwenStepSampler, Qwen2VLVideoProcessor, {}),
    "qwen3_vl": (SpreadSampler, Qwen3VLVideoProcessor, {}),
    "llava_onevision": (StepSampler, LlavaOnevisionVideoProcessor, {}),
    # SmolVLM2's checkpoints: video_sampling = {fps: 1, max_frames: 64}
    "smolvlm": (SmolVLMSampler, SmolVLMVideoProcessor, {"fps": 1, "num_frames": 64}),
    # Gemma 4's: BaseVideoProcessor's sampling with num_frames = 32
    "by_count": (StepSampler, LlavaOnevisionVideoProcessor, {"num_frames": 32}),
    "internvl": (ShiftedStepSampler, InternVLVideoProcessor, {}),
    # a checkpoint that starts at the first frame
    "internvl_unshifted": (ShiftedStepSampler, InternVLVideoProcessor, {"initial_shift": False}),
    # MiniCPM-V 4.6 (and MiniCPM-OCR): a frame a second; past 8 s (a lower cap than the
    # processor's 128), tenths of a second spread
    "minicpmv": (SecondSampler, MiniCPMV4_6VideoProcessor, {}),
    "minicpmv_capped": (SecondSampler, MiniCPMV4_6VideoProcessor, {"max_num_frames": 8}),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_keeps_the_frames_its_transformers_processor_keeps(family):
    sampler_class, processor_class, settings = FAMILIES[family]
    sampler = sampler_class(**{k: v for k, v in settings.items()})
    compared = 0
    for (total, source_fps), rate in itertools.product(VIDEOS, RATES):
        ask = {"fps": rate}  # by_count: the processor's num_frames wins over it, as there
        expected = transformers_indices(processor_class, settings, total, source_fps, **ask)
        ours = sampler.indices(total, source_fps, **ask).tolist()
        if expected is None:  # transformers refuses: every frame, or the first, instead
            assert ours == list(range(total)) or ours == [0], (total, source_fps, rate)
            continue
        assert ours == sorted(set(expected)), (total, source_fps, rate, expected)
        compared += 1
    assert compared >= 25


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava_onevision", "smolvlm",
                                    "internvl"])
@pytest.mark.parametrize("count", [4, 8, 10, 32])
def test_sampling_by_frame_count_is_transformers(family, count):
    sampler_class, processor_class, settings = FAMILIES[family]
    sampler = sampler_class(**settings)
    for total, source_fps in VIDEOS:
        expected = transformers_indices(processor_class, settings, total, source_fps,
                                        num_frames=count)
        ours = sampler.indices(total, source_fps, num_frames=count).tolist()
        if expected is None:
            assert ours == list(range(total)) or ours == [0]
            continue
        assert ours == sorted(set(expected)), (total, source_fps, count, expected)


def test_the_issues_example_two_seconds_at_eight_fps():
    """Qwen2-VL steps evenly (0, 4, 8, 12); Qwen3-VL spreads to the last frame."""
    assert QwenStepSampler().indices(16, 8.0, fps=2.0).tolist() == [0, 4, 8, 12]
    assert SpreadSampler().indices(16, 8.0, fps=2.0).tolist() == [0, 5, 10, 15]
    assert transformers_indices(Qwen2VLVideoProcessor, {}, 16, 8.0, fps=2.0) == [0, 4, 8, 12]


def test_defaults_come_from_the_processors_settings():
    """What a processor's attributes say (its checkpoint config) sets the sampler."""
    qwen3 = SimpleNamespace(frame_sampling="qwen3_vl", fps=1, min_frames=2, max_frames=10,
                            num_frames=None)
    sampler = sampler_for(qwen3)
    assert sampler == SpreadSampler(fps=1, min_frames=2, max_frames=10)
    assert sampler.indices(300, 30.0).tolist() == np.linspace(0, 299, 10).round().tolist()
    expected = transformers_indices(Qwen3VLVideoProcessor, {"min_frames": 2, "max_frames": 10},
                                    300, 30.0, fps=1)
    assert sampler.indices(300, 30.0).tolist() == expected
    assert sampler_for(SimpleNamespace()) == FrameSampler()
    assert set(SAMPLERS) >= {"spread", "step", "qwen2_vl", "qwen3_vl", "smolvlm", "internvl"}
    with pytest.raises(ValueError, match="unknown frame sampling"):
        sampler_for(SimpleNamespace(frame_sampling="montage"))


def test_a_frame_cap_spreads_minicpm_v_frames():
    """``load_video``'s ``max_frames`` (asked as ``num_frames``) keeps that many of the
    one-a-second frames, spread; without it the call's ``fps`` is ignored, as there."""
    sampler = SecondSampler()
    assert sampler.indices(100, 10.0, fps=4.0).tolist() == list(range(0, 100, 10))
    assert sampler.indices(100, 10.0, num_frames=4).tolist() == [0, 30, 60, 90]


def test_load_video_samples_with_the_family_sampler_in_time_order(tmp_path):
    frames = coloured_frames(16, 64, 48, seed=4)
    clip = write_video(tmp_path / "clip.mp4", frames, fps=8)
    qwen2 = load_video(clip, fps=2.0, sampler=QwenStepSampler(), with_audio=False)
    assert qwen2.frame_indices.tolist() == [0, 4, 8, 12]
    spread = load_video(clip, fps=2.0, with_audio=False)
    assert spread.frame_indices.tolist() == [0, 5, 10, 15]
    errors = np.abs(frames[None].astype(int) - qwen2.frames[:, None].astype(int)).mean((2, 3, 4))
    assert errors.argmin(axis=1).tolist() == [0, 4, 8, 12]  # the frames, in time order
    assert np.all(np.diff(qwen2.timestamps) > 0)
    by_count = load_video(clip, num_frames=5, sampler=StepSampler(), with_audio=False)
    assert by_count.frame_indices.tolist() == [0, 3, 6, 9, 12]
    capped = load_video(clip, fps=8.0, max_frames=6, sampler=QwenStepSampler(),
                        with_audio=False)
    assert capped.frame_indices.tolist() == transformers_indices(
        Qwen2VLVideoProcessor, {}, 16, 8.0, num_frames=6)
