"""Video for Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and their MoE models: mlxvlm's numpy
video processors against transformers' maths, and the models against transformers on
videos PyAV writes offline.

The processor's pieces are checked one by one (resizing bit for bit against torch's
uint8 kernel, the patch layout against the PIL image processor, the whole pipeline
against transformers' steps in torch); then the models against transformers' own
processor for the checkpoint -- torchvision's video processor, sampling the frames itself
-- through ``apply_chat_template(tokenize=True)`` (tests/video_reference.py): the same
prompt (Qwen3-VL: its timestamps), the same pixels, logits of the first forward pass
(<= 1e-4) and 24 greedy tokens, for a video alone, after an image and a long one (shrunk
to Qwen3-VL's budget for a whole video), on tiny checkpoints in both config layouts.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from av_media import coloured_frames, sine, write_video
from parity import LOGITS_ATOL, MIN_REFERENCE_MARGIN, NEW_TOKENS
from tiny import make_image
from tiny.qwen import QWEN3_VIDEO_MAX_PIXELS
from video_reference import transformers_inputs
from mlxvlm import load, stream_generate
from mlxvlm.models.qwen_video import QwenVideoProcessor, resize_bicubic_uint8, smart_resize
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
QWEN3 = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # Qwen3-VL's video processor
IMAGE = make_image(84, 56, seed=2)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """Video files: two 3 s clips at 10 fps (the second with other content and a sound
    track) and a 12 s one; sampled at 2 fps, 6 frames of 96x64 (24 for the long one)."""
    root = tmp_path_factory.mktemp("videos")
    return {
        "clip": write_video(root / "clip.mp4", coloured_frames(30, 96, 64, seed=21), fps=10),
        "other": write_video(root / "other.mp4", coloured_frames(30, 96, 64, seed=16), fps=10,
                             audio=sine(3.0, 16000)),
        "long": write_video(root / "long.mp4", coloured_frames(120, 96, 64, seed=26), fps=10),
    }


QUESTION = "What is shown here?"
COMPARE = "Is this picture in"


def cases(videos):
    """case -> messages naming the video files (and images) as a user writes them."""
    def video_turn(name):
        return [{"role": "user", "content": [
            {"type": "video", "video": str(videos[name])},
            {"type": "text", "text": QUESTION}]}]
    mixed_turn = [{"role": "user", "content": [
        {"type": "image", "image": IMAGE}, {"type": "text", "text": COMPARE},
        {"type": "video", "video": str(videos["clip"])}, {"type": "text", "text": "this video."}]}]
    return {"video": video_turn("clip"), "image_and_video": mixed_turn,
            "other_video": video_turn("other"), "long_video": video_turn("long")}


def fps_asked(family):
    """Qwen3-VL's processor samples at 2 fps by itself; Qwen2-VL's samples only when
    asked (else it takes every frame), so both sides are asked for 2 fps."""
    return None if family in QWEN3 else 2.0


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return functools.cache(lambda family, layout: load(tiny_checkpoints.path(family, layout)))


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, videos):
    """(family, case) -> transformers' inputs, logits, greedy tokens, and each step's
    top-1/top-2 margin."""

    @functools.cache
    def run(family, case):
        model = tiny_checkpoints.model(family).model
        batch = transformers_inputs(tiny_checkpoints.path(family, "transformers"),
                                    cases(videos)[case], fps_asked(family),
                                    cap_pixels_per_frame=False)
        with torch.no_grad():
            logits = model(**batch).logits[0].numpy()
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[0, batch["input_ids"].shape[1]:].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        return batch, logits, tokens, margins

    return run


# --------------------------------------------------------- the numpy video processor


@pytest.mark.parametrize("size,new_size", [
    ((64, 96), (56, 84)), ((90, 160), (28, 56)), ((33, 47), (84, 112)), ((240, 320), (112, 140)),
    ((64, 96), (64, 56)), ((64, 96), (28, 96)),
])
def test_resize_is_torchvisions_uint8_bicubic_bit_for_bit(size, new_size):
    rng = np.random.default_rng(sum(size))
    noise = rng.integers(0, 256, (2, *size, 3), dtype=np.uint8)  # overshoots get clamped
    smooth = coloured_frames(2, size[1], size[0])
    for frames in (noise, smooth):
        ours = resize_bicubic_uint8(frames, *new_size)
        tensor = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
        theirs = torch.nn.functional.interpolate(
            tensor, size=list(new_size), mode="bicubic", antialias=True, align_corners=False
        ).permute(0, 2, 3, 1).numpy()
        np.testing.assert_array_equal(ours, theirs)


def test_patches_of_paired_frames_are_the_image_processors_patches():
    """Frames already at a size smart_resize keeps, each shown twice: every temporal patch
    holds one frame, as the image processor makes of that frame alone."""
    from transformers import Qwen2VLImageProcessorPil

    frames = coloured_frames(3, 84, 56, seed=3)
    paired = np.repeat(frames, 2, axis=0)
    video = QwenVideoProcessor(min_pixels=56 * 56, max_pixels=112 * 112)(
        [paired], return_tensors="np")
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)(
        list(frames), return_tensors="np")
    assert video["video_grid_thw"].tolist() == [[3, 4, 6]]
    assert images["image_grid_thw"].tolist() == [[1, 4, 6]] * 3
    np.testing.assert_allclose(video["pixel_values_videos"], images["pixel_values"],
                               rtol=0, atol=2e-6)


def transformers_video_patches(frames: np.ndarray, processor: QwenVideoProcessor):
    """Qwen2VLVideoProcessor._preprocess's steps for one video, with torch (see the module
    docstring): what transformers computes where torchvision is installed."""
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()[None]  # B, T, C, H, W
    t, c, h, w = video.shape[1:]
    p, m, tps = processor.patch_size, processor.merge_size, processor.temporal_patch_size
    new_h, new_w = smart_resize(h, w, p * m, processor.size["shortest_edge"],
                                processor.size["longest_edge"])
    if (new_h, new_w) != (h, w):
        video = torch.nn.functional.interpolate(
            video.reshape(-1, c, h, w), size=[new_h, new_w], mode="bicubic", antialias=True,
            align_corners=False).reshape(1, t, c, new_h, new_w)
    mean = torch.tensor(processor.image_mean) * (1.0 / processor.rescale_factor)
    std = torch.tensor(processor.image_std) * (1.0 / processor.rescale_factor)
    video = (video.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
    if pad := -t % tps:
        video = torch.cat([video, video[:, -1:].expand(-1, pad, -1, -1, -1)], dim=1)
    gt, gh, gw = video.shape[1] // tps, new_h // p, new_w // p
    patches = video.view(1, gt, tps, c, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(gt * gh * gw, c * tps * p * p).numpy(), [gt, gh, gw]


@pytest.mark.parametrize("count,height,width", [(6, 64, 96), (5, 90, 160), (1, 300, 200)])
def test_whole_pipeline_matches_transformers_steps(count, height, width):
    frames = coloured_frames(count, width, height, seed=count)
    processor = QwenVideoProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    out = processor([frames], return_tensors="np")
    expected, grid = transformers_video_patches(frames, processor)
    assert out["video_grid_thw"].tolist() == [grid]
    np.testing.assert_array_equal(out["pixel_values_videos"], expected)


def test_settings_are_read_where_transformers_reads_them(tmp_path):
    import json

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 1000, "max_pixels": 5000, "patch_size": 16, "image_mean": [0.5] * 3}))
    legacy = QwenVideoProcessor.from_pretrained(tmp_path)
    assert legacy.size == {"shortest_edge": 1000, "longest_edge": 5000}
    assert legacy.patch_size == 16 and legacy.image_mean == [0.5] * 3
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 10, "longest_edge": 20}}))
    assert QwenVideoProcessor.from_pretrained(tmp_path).size == {"shortest_edge": 10,
                                                                 "longest_edge": 20}
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"video_processor": {"temporal_patch_size": 4}}))
    assert QwenVideoProcessor.from_pretrained(tmp_path).temporal_patch_size == 4
    with pytest.raises(NotImplementedError, match="only bicubic"):
        QwenVideoProcessor(resample=2)([coloured_frames(1, 56, 56)])


def test_pixels_per_frame_cap():
    """cap_pixels_per_frame (qwen-vl-utils' total budget) shrinks long videos' frames."""
    processor = QwenVideoProcessor(min_pixels=28 * 28, max_pixels=112 * 112)
    frames = coloured_frames(8, 112, 112)
    assert processor([frames])["video_grid_thw"].tolist() == [[4, 8, 8]]
    capped = processor([frames], cap_pixels_per_frame=True, max_video_tokens=40)
    # 40 tokens * 28^2 * 0.9 = 28224 pixels for the video, x2 / 8 frames -> 7056 per frame
    assert capped["video_grid_thw"].tolist() == [[4, 6, 6]]


# ------------------------------------------------------------------------------ parity


# Every case in transformers 5's layout; the Hub's (processor settings read from its
# files) with the video alone.
PARITY_RUNS = [(family, "transformers", case) for family in FAMILIES
               for case in ("video", "image_and_video", "long_video")]
PARITY_RUNS += [(family, "hub", "video") for family in FAMILIES]
# Where float32 cannot hold LOGITS_ATOL. Qwen3.5's long video: at one row (a timestamp
# digit after the 10th of 12 frame pairs) both linear layers' core outputs are ~1e-3 of their size at
# other rows and their gated RMSNorm scales them back up, float32 rounding with them.
# Measured on an AVX2 EPYC against transformers in float64: transformers' float32 2.2e-5
# off there, ours 1.4e-4 (1.5e-4 from transformers' float32); every other row of ours
# within 2.1e-5.
CASE_ATOL = {("qwen3_5", "long_video"): 3e-4}


@pytest.mark.parametrize("family,layout,case", PARITY_RUNS)
def test_video_logits_and_greedy_tokens_match_transformers(family, layout, case, loaded,
                                                           reference, videos):
    model, processor = loaded(family, layout)
    messages = cases(videos)[case]
    batch, ref_logits, ref_tokens, margins = reference(family, case)
    fps = fps_asked(family)
    options = {} if fps is None else {"fps": fps}
    inputs = prepare_inputs(processor, messages, feature_names=model.feature_names,
                            video_options=options)
    # the same frames, sampled the same way: the same prompt (Qwen3-VL: its timestamps)
    # and the same pixels
    assert inputs.input_ids[0].tolist() == batch["input_ids"][0].tolist()
    assert inputs.num_videos == 1
    np.testing.assert_array_equal(np.array(inputs.features["video_grid_thw"]),
                                  batch["video_grid_thw"].numpy())
    np.testing.assert_array_equal(np.array(inputs.features["pixel_values_videos"]),
                                  batch["pixel_values_videos"].numpy())
    if family == "qwen2_5_vl":
        np.testing.assert_array_equal(np.array(inputs.features["second_per_grid_ts"]),
                                      np.asarray(batch["second_per_grid_ts"], np.float32))
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    np.testing.assert_allclose(np.array(logits[0]), ref_logits, rtol=0,
                               atol=CASE_ATOL.get((family, case), LOGITS_ATOL))

    # Tokens are compared where transformers' own choice is decisive: up to its first
    # near-tie (a top-1/top-2 margin under MIN_REFERENCE_MARGIN, where float32 rounding
    # on another CPU may pick the other token), and that must leave most of the answer.
    assert len(ref_tokens) == NEW_TOKENS
    decisive = next((i for i, m in enumerate(margins) if m <= MIN_REFERENCE_MARGIN),
                    NEW_TOKENS)
    assert decisive >= NEW_TOKENS // 3, f"the reference is a near-tie at token {decisive}"
    results = stream_generate(model, processor, messages, fps=fps, max_tokens=NEW_TOKENS,
                              prefill_step_size=7)
    assert [r.token for r in results][:decisive] == ref_tokens[:decisive]


def test_sampling_follows_each_familys_processor(loaded, videos):
    """12 s at 10 fps asked at 2 fps: Qwen2-VL's processor steps 5 frames apart from the
    first; Qwen3-VL's spreads 24 frames from the first to the last (timestamps between
    each pair of frames); and Qwen3-VL's budget for the whole video shrinks its frames."""
    _, qwen2 = loaded("qwen2_vl", "transformers")
    _, qwen3 = loaded("qwen3_vl", "transformers")
    messages = cases(videos)["long_video"]
    step = prepare_inputs(qwen2, messages, video_options={"fps": 2.0})
    spread = prepare_inputs(qwen3, messages)
    assert np.array(step.features["video_grid_thw"]).tolist() == [[12, 4, 6]]
    t, h, w = np.array(spread.features["video_grid_thw"])[0].tolist()
    assert t == 12 and 2 * t * h * w * 16 * 16 <= QWEN3_VIDEO_MAX_PIXELS < 24 * 96 * 64
    prompt = qwen3.tokenizer.decode(spread.input_ids[0].tolist())
    assert "<0.2 seconds>" in prompt and "<11.7 seconds>" in prompt


@pytest.mark.parametrize("family", FAMILIES)
def test_another_video_changes_the_output(family, loaded, reference, videos):
    model, processor = loaded(family, "transformers")
    tokens = [r.token for r in stream_generate(model, processor, cases(videos)["other_video"],
                                               fps=fps_asked(family), max_tokens=NEW_TOKENS)]
    assert tokens == reference(family, "other_video")[2]
    assert tokens != reference(family, "video")[2]


def test_video_by_argument_and_media_errors(loaded, videos, reference):
    """A path passed as video= goes through load_video with the fps asked; audio is
    refused by a model that cannot hear, and video by a processor built without it."""
    from mlxvlm.errors import MlxvlmError
    from mlxvlm.models import qwen2_vl

    model, processor = loaded("qwen2_vl", "transformers")
    tokens = [r.token for r in stream_generate(model, processor, QUESTION,
                                               video=str(videos["clip"]), fps=2.0,
                                               max_tokens=4)]
    assert tokens == reference("qwen2_vl", "video")[2][:4]
    with pytest.raises(MlxvlmError, match="does not take audio"):
        prepare_inputs(processor, "Listen.", audio=np.zeros(16000, np.float32))
    images_only = qwen2_vl.load_processor(processor.tokenizer.name_or_path, {}, video=False)
    with pytest.raises(MlxvlmError, match="does not take video"):
        prepare_inputs(images_only, "Watch.", video=[str(videos["clip"])])
