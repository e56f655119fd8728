"""Video for GLM-4.6V-Flash and GLM-4.6V: mlxvlm's frame sampling and numpy video
processor against transformers' torchvision ``Glm46VVideoProcessor``, and the models
against transformers' own processor for the checkpoint (tests/video_reference.py) on
videos PyAV writes offline: the same prompt (each frame pair's image block and its
timestamp), the same pixels, first-pass logits within 1e-4 and the greedy tokens."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from av_media import coloured_frames, write_video
from parity import LOGITS_ATOL, MIN_REFERENCE_MARGIN, NEW_TOKENS
from tiny import make_image
from tiny.glm4v import FAMILIES, build_video_processor
from video_reference import transformers_inputs
from mlxvlm import load, stream_generate
from mlxvlm.media.frame_sampling import GlmDynamicSampler, GlmFpsSampler
from mlxvlm.models.glm_video import Glm4vVideoProcessor, Glm46VVideoProcessor
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

IMAGE = make_image(84, 56, seed=2)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """A 3 s clip at 10 fps (18 frames sampled: 3 a second, twice) and a 4 s one."""
    root = tmp_path_factory.mktemp("videos")
    return {
        "clip": write_video(root / "clip.mp4", coloured_frames(30, 96, 64, seed=21), fps=10),
        "other": write_video(root / "other.mp4", coloured_frames(40, 96, 64, seed=16), fps=10),
    }


def cases(videos):
    def video_turn(name):
        return [{"role": "user", "content": [
            {"type": "video", "video": str(videos[name])},
            {"type": "text", "text": "What is shown here?"}]}]
    return {"video": video_turn("clip"), "other_video": video_turn("other")}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return functools.cache(lambda family, layout: load(tiny_checkpoints.path(family, layout)))


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, videos):
    """(family, case) -> transformers' inputs, logits, greedy tokens and margins."""

    @functools.cache
    def run(family, case):
        model = tiny_checkpoints.model(family).model
        batch = transformers_inputs(tiny_checkpoints.path(family, "transformers"), cases(videos)[case])
        with torch.no_grad():
            logits = model(**batch).logits[0].numpy()
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[0, batch["input_ids"].shape[1]:].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        return batch, logits, tokens, margins

    return run


# ------------------------------------------------------------ sampling and processing


@pytest.mark.parametrize("total,fps", [
    (30, 10), (40, 10), (7, 30), (300, 30), (3600, 10), (95, 24), (2, 1), (1200, 25),
    (90000, 30),
])
def test_frame_sampling_is_transformers(total, fps):
    """Short, long and very long videos (the rate and the frame cap change): the frames
    transformers keeps (its repeated last one is the processor's padding here)."""
    from transformers.video_utils import VideoMetadata

    theirs = build_video_processor().sample_frames(
        VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps))
    ours = GlmDynamicSampler().indices(total, fps)
    np.testing.assert_array_equal(ours, np.unique(theirs))


@pytest.mark.parametrize("total,fps,asked", [
    (30, 10, None), (40, 10, 1.0), (7, 30, None), (95, 24, 3.0), (2, 1, None),
    (9000, 25, None), (12000, 30, 0.5),
])
def test_glm41v_frame_sampling_is_transformers(total, fps, asked):
    """GLM-4.1V's processor: the fps asked (2 by default), spread past 300 s."""
    from transformers import Glm4vVideoProcessor as TransformersProcessor
    from transformers.video_utils import VideoMetadata

    theirs = TransformersProcessor().sample_frames(
        VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps), fps=asked)
    ours = GlmFpsSampler().indices(total, fps, fps=asked)
    np.testing.assert_array_equal(ours, np.unique(theirs))


@pytest.mark.parametrize("count,height,width", [(18, 64, 96), (7, 90, 40), (4, 28, 28)])
def test_numpy_processor_is_transformers(count, height, width):
    """The same frames through both processors (sampling off): the same patches and
    grids, the frame count padded to whole temporal patches."""
    frames = coloured_frames(count, width, height, seed=count)
    settings = build_video_processor().to_dict()
    theirs = build_video_processor()(videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)],
                                     do_sample_frames=False, return_tensors="np")
    ours = Glm46VVideoProcessor(**settings)(videos=[frames], return_tensors="np")
    np.testing.assert_array_equal(ours["video_grid_thw"], theirs["video_grid_thw"])
    np.testing.assert_allclose(ours["pixel_values_videos"], theirs["pixel_values_videos"],
                               rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_video_logits_and_greedy_tokens_match_transformers(family, layout, loaded, reference,
                                                           videos):
    model, processor = loaded(family, layout)
    messages = cases(videos)["video"]
    batch, ref_logits, ref_tokens, margins = reference(family, "video")
    inputs = prepare_inputs(processor, messages, feature_names=model.feature_names)
    assert inputs.input_ids[0].tolist() == batch["input_ids"][0].tolist()  # the timestamps
    np.testing.assert_array_equal(np.array(inputs.features["video_grid_thw"]),
                                  batch["video_grid_thw"].numpy())
    np.testing.assert_allclose(np.array(inputs.features["pixel_values_videos"]),
                               batch["pixel_values_videos"].numpy(), rtol=0, atol=1e-5)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    np.testing.assert_allclose(np.array(logits[0]), ref_logits, rtol=0, atol=LOGITS_ATOL)
    # tokens up to transformers' first near-tie, which must leave most of the answer
    assert len(ref_tokens) == NEW_TOKENS
    decisive = next((i for i, m in enumerate(margins) if m <= MIN_REFERENCE_MARGIN), NEW_TOKENS)
    assert decisive >= NEW_TOKENS // 3, f"the reference is a near-tie at token {decisive}"
    results = stream_generate(model, processor, messages, max_tokens=NEW_TOKENS,
                              temperature=0.0, prefill_step_size=7)
    assert [r.token for r in results][:decisive] == ref_tokens[:decisive]


def test_the_prompt_carries_each_frame_pairs_timestamp(loaded, videos):
    """18 frames of the 3 s clip: 9 image blocks, each followed by the time of its pair's
    first frame, from 0.0 on, rising, within the clip."""
    import re

    _, processor = loaded("glm4v", "hub")
    inputs = prepare_inputs(processor, cases(videos)["video"])
    prompt = processor.tokenizer.decode(inputs.input_ids[0].tolist())
    stamps = [float(s) for s in re.findall(r"<\|end_of_image\|>(\d+\.\d) seconds", prompt)]
    assert len(stamps) == prompt.count("<|begin_of_image|>") == 9
    assert stamps[0] == 0.0 and stamps == sorted(set(stamps)) and stamps[-1] < 3


def test_glm41v_processor_checkpoints_take_videos(tmp_path, tiny_checkpoints, videos):
    """A checkpoint naming GLM-4.1V's processors: its frames (2 a second: 6 of the 3 s
    clip) and whole-second timestamps, as transformers' own processor for it gives."""
    import json
    import shutil

    copy = tmp_path / "glm41v"
    shutil.copytree(tiny_checkpoints.path("glm4v", "transformers"), copy)
    settings = json.loads((copy / "processor_config.json").read_text())
    settings["processor_class"] = "Glm4vProcessor"
    settings["video_processor"]["video_processor_type"] = "Glm4vVideoProcessor"
    settings["image_processor"]["image_processor_type"] = "Glm4vImageProcessor"
    (copy / "processor_config.json").write_text(json.dumps(settings))
    model, processor = load(copy)
    assert isinstance(processor.video_processor, Glm4vVideoProcessor)
    messages = cases(videos)["video"]
    batch = transformers_inputs(copy, messages)
    inputs = prepare_inputs(processor, messages, feature_names=model.feature_names)
    assert inputs.input_ids[0].tolist() == batch["input_ids"][0].tolist()
    assert processor.tokenizer.decode(inputs.input_ids[0].tolist()).count("<|begin_of_image|>") == 3
    np.testing.assert_allclose(np.array(inputs.features["pixel_values_videos"]),
                               batch["pixel_values_videos"].numpy(), rtol=0, atol=1e-5)


def test_another_video_changes_the_output(loaded, reference, videos):
    model, processor = loaded("glm4v", "hub")
    other = stream_generate(model, processor, cases(videos)["other_video"], max_tokens=NEW_TOKENS,
                            temperature=0.0)
    assert [r.token for r in other] != reference("glm4v", "video")[2]
