"""Gemma 4 video: frames sampled by count (``num_frames``, one even step apart, as
transformers' Gemma 4 video processor samples), mlxvlm's numpy video processor against
transformers' own (torchvision), and the model against transformers' through
apply_chat_template: logits (<= 1e-4) and 24 greedy tokens, a video alone and with an
image, both layouts; another video changes the answer."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from av_media import coloured_frames, write_video
from parity import LOGITS_ATOL, MIN_REFERENCE_MARGIN, NEW_TOKENS
from tiny import make_image
from tiny.gemma4 import VIDEO_PROCESSOR
from video_reference import transformers_inputs
from mlxvlm import load, stream_generate
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")

FAMILY = "gemma4"
IMAGE = make_image(84, 56, seed=2)
QUESTION = "What is shown here?"


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    return {
        "clip": write_video(root / "clip.mp4", coloured_frames(30, 96, 64, seed=21), fps=10),
        "other": write_video(root / "other.mp4", coloured_frames(30, 96, 64, seed=7), fps=10),
    }


def cases(videos):
    def video_turn(name):
        return [{"role": "user", "content": [{"type": "video", "video": str(videos[name])},
                                             {"type": "text", "text": QUESTION}]}]
    mixed = [{"role": "user", "content": [
        {"type": "image", "image": IMAGE}, {"type": "video", "video": str(videos["clip"])},
        {"type": "text", "text": "Is this picture in this video?"}]}]
    return {"video": video_turn("clip"), "image_and_video": mixed,
            "other_video": video_turn("other")}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return functools.cache(lambda layout: load(tiny_checkpoints.path(FAMILY, layout)))


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, videos):
    @functools.cache
    def run(case):
        model = tiny_checkpoints.model(FAMILY).model
        batch = transformers_inputs(tiny_checkpoints.path(FAMILY, "transformers"),
                                    cases(videos)[case])
        with torch.no_grad():
            logits = model(**batch).logits[0].numpy()
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[0, batch["input_ids"].shape[1]:].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        return batch, logits, tokens, min(margins)

    return run


RUNS = [("transformers", "video"), ("transformers", "image_and_video"), ("hub", "video")]


@pytest.mark.parametrize("layout,case", RUNS)
def test_video_logits_and_greedy_tokens_match_transformers(layout, case, loaded, reference,
                                                           videos):
    model, processor = loaded(layout)
    messages = cases(videos)[case]
    batch, ref_logits, ref_tokens, margin = reference(case)
    inputs = prepare_inputs(processor, messages, feature_names=model.feature_names)
    assert inputs.input_ids[0].tolist() == batch["input_ids"][0].tolist()
    np.testing.assert_array_equal(np.array(inputs.features["pixel_values_videos"]),
                                  batch["pixel_values_videos"].numpy())
    np.testing.assert_array_equal(np.array(inputs.features["video_position_ids"]),
                                  batch["video_position_ids"].numpy())
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    np.testing.assert_allclose(np.array(logits[0]), ref_logits, rtol=0, atol=LOGITS_ATOL)

    assert len(ref_tokens) == NEW_TOKENS and margin > MIN_REFERENCE_MARGIN
    results = stream_generate(model, processor, messages, max_tokens=NEW_TOKENS)
    assert [r.token for r in results] == ref_tokens


def test_frames_are_sampled_by_count(loaded, videos):
    """3 s at 10 fps: the processor's ``num_frames`` (4) frames one step apart, whatever
    the rate; each a picture of its own with its timestamp."""
    model, processor = loaded("transformers")
    inputs = prepare_inputs(processor, cases(videos)["video"], feature_names=model.feature_names)
    frames = np.array(inputs.features["pixel_values_videos"]).shape[0]
    assert frames == VIDEO_PROCESSOR["num_frames"]
    assert inputs.prompt_text.count("<|video|>") == 1  # the template's one placeholder
    text = processor.tokenizer.decode(inputs.input_ids[0].tolist())
    for timestamp in ("00:00", "00:00", "00:01", "00:02"):
        assert timestamp in text


def test_another_video_changes_the_output(loaded, reference, videos):
    model, processor = loaded("transformers")
    tokens = [r.token for r in stream_generate(model, processor, cases(videos)["other_video"],
                                               max_tokens=NEW_TOKENS)]
    assert tokens == reference("other_video")[2]
    assert tokens != reference("video")[2]
