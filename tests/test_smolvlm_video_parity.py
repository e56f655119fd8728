"""SmolVLM2 video: frames sampled as transformers' SmolVLM processor samples them (at
the checkpoint's 1 fps, at most its 64 frames, skipping a second at each end of a long
video), each frame resized as torchvision resizes it (Lanczos) into one tile after its
timestamp, and the model against transformers' through apply_chat_template: logits
(<= 1e-4) and 24 greedy tokens, for a short and a long video. (transformers' SmolVLM
processor returns a video's frames under the images' name, pixel_values, so a video and
an image in one prompt is not something it can do.)"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from av_media import coloured_frames, write_video
from parity import LOGITS_ATOL, MIN_REFERENCE_MARGIN, NEW_TOKENS
from video_reference import transformers_inputs
from mlxvlm import load, stream_generate
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")
pytest.importorskip("num2words")  # SmolVLM's processor spells out the frame count

FAMILY = "smolvlm"
QUESTION = "What is shown here?"


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    return {
        "clip": write_video(root / "clip.mp4", coloured_frames(40, 96, 64, seed=21), fps=10),
        "other": write_video(root / "other.mp4", coloured_frames(40, 96, 64, seed=16), fps=10),
        "long": write_video(root / "long.mp4", coloured_frames(100, 64, 96, seed=26), fps=5),
    }


def turn(videos, name):
    return [{"role": "user", "content": [{"type": "video", "video": str(videos[name])},
                                         {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return functools.cache(lambda layout: load(tiny_checkpoints.path(FAMILY, layout)))


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, videos):
    """transformers' SmolVLM processor of the Hub-layout checkpoint (the one naming
    SmolVLMProcessor), sampling at its own settings."""

    @functools.cache
    def run(name):
        model = tiny_checkpoints.model(FAMILY).model
        batch = transformers_inputs(tiny_checkpoints.path(FAMILY, "hub"), turn(videos, name))
        with torch.no_grad():
            logits = model(**batch).logits[0].numpy()
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[0, batch["input_ids"].shape[1]:].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        return batch, logits, tokens, min(margins)

    return run


@pytest.mark.parametrize("layout,name", [("hub", "clip"), ("hub", "long"),
                                         ("transformers", "clip")])
def test_video_logits_and_greedy_tokens_match_transformers(layout, name, loaded, reference,
                                                           videos):
    model, processor = loaded(layout)
    messages = turn(videos, name)
    batch, ref_logits, ref_tokens, margin = reference(name)
    inputs = prepare_inputs(processor, messages, feature_names=model.feature_names)
    assert inputs.input_ids[0].tolist() == batch["input_ids"][0].tolist()
    np.testing.assert_array_equal(np.array(inputs.features["pixel_values"]),
                                  batch["pixel_values"].numpy())
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    np.testing.assert_allclose(np.array(logits[0]), ref_logits, rtol=0, atol=LOGITS_ATOL)

    assert len(ref_tokens) == NEW_TOKENS and margin > MIN_REFERENCE_MARGIN
    results = stream_generate(model, processor, messages, max_tokens=NEW_TOKENS,
                              prefill_step_size=7)
    assert [r.token for r in results] == ref_tokens


def test_frames_and_timestamps_as_smolvlm_samples(loaded, videos):
    """4 s at 10 fps, 1 fps: 4 frames from first to last; 20 s at 5 fps: 20 frames from
    the first to the last (a second is skipped at each end only of a video longer than
    2 s plus 64 frames at 1 fps); every frame after its timestamp, in time order."""
    _, processor = loaded("hub")
    short = prepare_inputs(processor, turn(videos, "clip"))
    assert np.array(short.features["pixel_values"]).shape[:2] == (1, 4)
    text = processor.tokenizer.decode(short.input_ids[0].tolist())
    assert "four frames from a 0:00:04" in text
    assert [text.index(f"Frame from 00:0{s}:") for s in (0, 1, 2, 3)] == sorted(
        text.index(f"Frame from 00:0{s}:") for s in (0, 1, 2, 3))
    long = prepare_inputs(processor, turn(videos, "long"))
    assert np.array(long.features["pixel_values"]).shape[:2] == (1, 20)
    text = processor.tokenizer.decode(long.input_ids[0].tolist())
    stamps = [text.index(f"Frame from 00:{s:02d}:") for s in range(20)]
    assert stamps == sorted(stamps) and "twenty frames from a 0:00:20" in text


def test_another_video_changes_the_output(loaded, reference, videos):
    model, processor = loaded("hub")
    tokens = [r.token for r in stream_generate(model, processor, turn(videos, "other"),
                                               max_tokens=NEW_TOKENS)]
    assert tokens == reference("other")[2]
    assert tokens != reference("clip")[2]
