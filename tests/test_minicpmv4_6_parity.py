"""MiniCPM-V 4.6 against transformers (float32), on a tiny random checkpoint
(tests/tiny/minicpmv4_6.py) in both layouts.

Through ``mlxvlm.load``: first-pass logits and 24 greedy tokens for text only, one image
(the whole picture and 2 x 2 slices), two images (that one and a wide one: 1 x 3
slices) and an image in a later turn; the tower's window merger and nearest-bucket
positions on grids of other shapes; the hybrid text model's state across decode steps
and prefill chunks; a short video clip (frames sampled, resized and sliced as
transformers' torchvision video processor does) through the API and ``--video`` in the
CLI; the CLI and the server entry points (two concurrent requests batched, then a later
turn with a new picture over the cached prefix); checkpoints in our names. Guards check
that the tests can fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

import parity
from parity import (
    CAUGHT,
    LOGITS_ATOL,
    NEW_TOKENS,
    assert_another_image_changes_the_output,
    assert_batched_tokens_match,
    assert_decode_steps_match,
    assert_first_pass_matches,
    assert_greedy_tokens_match,
    assert_reference_is_decisive,
    assert_wrong_model_is_caught,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    our_logits,
    our_tokens,
    parameter_list,
    read_config,
    reference_fixture,
    reference_run,
    save_as_mlx_checkpoint,
    standard_cases,
    user,
)
from tiny import make_image
from tiny.minicpmv4_6 import LAYOUTS, reference_processor
from mlxvlm import load
from mlxvlm.errors import MlxvlmError
from mlxvlm.models import minicpmv4_6
from mlxvlm.models.feature_cache import no_feature_cache
from mlxvlm.models.layers import minicpmv_vision

torch = pytest.importorskip("torch")

FAMILY = "minicpmv4_6"
IMAGE_A = make_image(80, 56, seed=1)  # the picture and 2 x 2 slices
IMAGE_WIDE = make_image(120, 40, seed=2)  # the picture and 1 x 3 slices
IMAGE_A2 = make_image(80, 56, seed=8)  # A's size, other content
IMAGE_NEXT = make_image(50, 70, seed=6)  # the later turn's picture

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_WIDE, IMAGE_A2)

reference = reference_fixture(reference_processor)


def greedy_text(processor, ref) -> str:
    return processor.tokenizer.decode(ref.tokens, skip_special_tokens=True)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_pass_logits_match_transformers(layout, case, loaded, reference):
    model, processor = loaded(FAMILY, layout)
    assert_first_pass_matches(model, processor, CASES[case], reference(FAMILY, case))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_tokens_match_transformers(layout, case, loaded, reference):
    model, processor = loaded(FAMILY, layout)
    assert_greedy_tokens_match(model, processor, CASES[case], reference(FAMILY, case))


def test_the_cases_cover_slices(loaded, reference):
    """A's picture and 2 x 2 slices, the wide one's picture and 1 x 3 slices, each view
    one token per 4 x 4 patches; each image after its id."""
    _, processor = loaded(FAMILY, "hub")
    tokens = processor.tokenizer.convert_tokens_to_ids
    ids = reference(FAMILY, "two_images").input_ids
    assert ids.count(tokens("<slice>")) == 4 + 3
    assert ids.count(tokens("<image>")) == ids.count(tokens("<image_id>")) == 2
    views = processor.image_processor([IMAGE_A, IMAGE_WIDE])
    assert views["grids"] == [[2, 2], [1, 3]]
    assert ids.count(tokens("<|image_pad|>")) == int(np.prod(views["target_sizes"], -1).sum()) // 16


def test_decode_steps_match_transformers(tiny_checkpoints, loaded, reference):
    """Teacher-forced on the reference's answer, every decode step (one token through the
    linear layers' state and the KV cache) gives transformers' logits."""
    model, processor = loaded(FAMILY, "hub")
    assert_decode_steps_match(tiny_checkpoints.model(FAMILY).model, model, processor,
                              CASES["two_images"], reference(FAMILY, "two_images"))


def test_chunked_prefill_gives_the_same_tokens(loaded, reference):
    model, processor = loaded(FAMILY, "hub")
    assert our_tokens(model, processor, *CASES["two_images"], prefill_step_size=16) == (
        reference(FAMILY, "two_images").tokens)


def test_batched_generation_gives_each_prompt_its_tokens(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_batched_tokens_match(model, processor, CASES, [reference(FAMILY, c) for c in CASES])


@pytest.mark.parametrize("rows,columns", [(8, 12), (12, 4), (16, 16)])
def test_tower_matches_transformers_on_other_grids(rows, columns, tiny_checkpoints, loaded):
    """Views whose grids differ from the position table's (nearest buckets, up and down)
    through the blocks, the window merger and the merger, against transformers'."""
    reference_model = tiny_checkpoints.model(FAMILY).model.model
    model, _ = loaded(FAMILY, "hub")
    p = model.args.vision.patch_size
    torch.manual_seed(rows * columns)
    pixels = torch.randn(1, 3, p, rows * columns * p)
    sizes = torch.tensor([[rows, columns]])
    with torch.no_grad():
        expected = reference_model.get_image_features(pixels, sizes).pooler_output[0].numpy()
    with no_feature_cache():
        ours = np.array(model.image_features(pixels.numpy(), sizes.numpy()))
    np.testing.assert_allclose(ours, expected, rtol=0, atol=LOGITS_ATOL)


def test_4x_mode_skips_the_window_merger(tiny_checkpoints, loaded):
    """``downsample_mode: "4x"`` (four times the tokens: no window merger) against
    transformers' features in that mode."""
    reference_model = tiny_checkpoints.model(FAMILY).model.model
    model, _ = loaded(FAMILY, "hub")
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    four = minicpmv4_6.Model.from_config({**config, "downsample_mode": "4x"})
    four.load_weights(parameter_list(model))
    p = model.args.vision.patch_size
    torch.manual_seed(5)
    pixels, sizes = torch.randn(1, 3, p, 8 * 12 * p), torch.tensor([[8, 12]])
    with torch.no_grad():
        expected = reference_model.get_image_features(pixels, sizes, downsample_mode="4x")
    expected = expected.pooler_output[0].numpy()
    with no_feature_cache():
        ours = np.array(four.image_features(pixels.numpy(), sizes.numpy()))
    assert ours.shape[0] == 8 * 12 // 4
    np.testing.assert_allclose(ours, expected, rtol=0, atol=LOGITS_ATOL)


def test_nearest_positions_are_transformers(tiny_checkpoints):
    from transformers.vision_utils import get_vision_nearest_position_ids

    for side in (8, 14, 32):
        for rows, columns in ((8, 12), (3, 40), (14, 14), (33, 7)):
            expected = get_vision_nearest_position_ids(torch.tensor([[rows, columns]]), side)
            ours = minicpmv_vision.nearest_positions(rows, columns, side)
            assert ours.tolist() == expected.tolist(), (side, rows, columns)


# ----------------------------------------------------------------------------- video

VIDEO_PROMPT = "Describe this video."


def write_clip(directory):
    """2.5 s at 10 fps of 48 x 32 frames: three frames sampled (0, 1 and 2 s), each the
    whole frame and 1 x 2 slices."""
    from av_media import coloured_frames, write_video

    return write_video(directory / "clip.mp4", coloured_frames(25, 48, 32, seed=21), fps=10)


@pytest.fixture(scope="module")
def video_file(tmp_path_factory):
    return write_clip(tmp_path_factory.mktemp("videos"))


def video_messages(video_file) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video", "video": str(video_file)},
                                         {"type": "text", "text": VIDEO_PROMPT}]}]


def transformers_video_reference(tiny_checkpoints, family: str, video_file):
    """transformers' inputs for the clip (its own torchvision video processor, sampling
    from the metadata) and its ``Reference``: first-pass logits, 24 greedy tokens."""
    from video_reference import transformers_inputs

    batch = transformers_inputs(tiny_checkpoints.path(family, "hub"), video_messages(video_file))
    model = tiny_checkpoints.model(family).model
    with torch.no_grad():
        logits = model(**batch).logits[0].numpy()
        out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, batch["input_ids"].shape[1]:].tolist()
    margin = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores)
    return batch, parity.Reference(batch["input_ids"][0].tolist(), logits, tokens, margin)


def assert_video_matches(model, processor, video_file, batch, ref) -> None:
    """The clip's frames (one a second), their views and pixels (torchvision's resize),
    the prompt's video runs, the first-pass logits and 24 greedy tokens through
    ``mlxvlm.stream_generate``: transformers'."""
    from mlxvlm.prompt import prepare_inputs

    assert_reference_is_decisive(ref)
    messages = video_messages(video_file)
    inputs = prepare_inputs(processor, messages, feature_names=model.feature_names)
    assert inputs.input_ids[0].tolist() == ref.input_ids
    assert np.asarray(inputs.features["target_sizes_videos"]).tolist() == (
        batch["target_sizes_videos"].tolist())
    assert len(batch["target_sizes_videos"]) == 3 * 3  # three frames, each whole + 1 x 2
    np.testing.assert_allclose(np.asarray(inputs.features["pixel_values_videos"]),
                               batch["pixel_values_videos"].numpy(), rtol=0, atol=1e-6)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = np.array(model(inputs.input_ids, model.make_cache(), embeddings=embeddings,
                            state=state)[0])
    np.testing.assert_allclose(logits, ref.logits, rtol=0, atol=LOGITS_ATOL)
    assert our_tokens(model, processor, messages, []) == ref.tokens


@pytest.fixture(scope="module")
def video_reference(tiny_checkpoints, video_file):
    return transformers_video_reference(tiny_checkpoints, FAMILY, video_file)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_video_matches_transformers(layout, loaded, video_file, video_reference):
    model, processor = loaded(FAMILY, layout)
    assert_video_matches(model, processor, video_file, *video_reference)


def test_cli_answers_a_video_with_the_reference_tokens(tiny_checkpoints, loaded, video_file,
                                                       video_reference):
    """``python -m mlxvlm.generate --video``, torch-free as users run it."""
    _, processor = loaded(FAMILY, "hub")
    _, ref = video_reference
    result = subprocess.run(
        [sys.executable, "-m", "mlxvlm.generate", "--model", str(tiny_checkpoints.path(FAMILY, "hub")),
         "--video", str(video_file), "--prompt", VIDEO_PROMPT,
         "--max-tokens", str(NEW_TOKENS), "--temperature", "0"],
        capture_output=True, env=entry_point_env(), timeout=300,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert result.stdout.decode() == greedy_text(processor, ref) + "\n"


def test_stacked_sub_second_frames_are_refused_clearly():
    from mlxvlm.models.minicpm_video import MiniCPMVideoProcessor

    with pytest.raises(MlxvlmError, match="stack_frames 3 .* not supported"):
        MiniCPMVideoProcessor(stack_frames=3)


# ----------------------------------------------------------------------- entry points


def entry_point_env() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MLXVLM_ALLOW_TORCH", None)  # as a user's process runs: torch-free
    return env


def test_cli_answers_with_the_reference_tokens(tmp_path, tiny_checkpoints, loaded, reference):
    _, processor = loaded(FAMILY, "hub")
    ref = reference(FAMILY, "one_image")
    assert_reference_is_decisive(ref)
    picture = tmp_path / "a.png"
    IMAGE_A.save(picture)
    result = subprocess.run(
        [sys.executable, "-m", "mlxvlm.generate", "--model", str(tiny_checkpoints.path(FAMILY, "hub")),
         "--image", str(picture), "--prompt", "Describe this image.",
         "--max-tokens", str(NEW_TOKENS), "--temperature", "0"],
        capture_output=True, env=entry_point_env(), timeout=300,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    # bytes: a random model's text may hold a carriage return, which text mode rewrites
    assert result.stdout.decode() == greedy_text(processor, ref) + "\n"


def test_server_batches_requests_and_reuses_a_turns_prefix(tiny_checkpoints, loaded, reference):
    """``python -m mlxvlm.server``: two requests at once (an image one and a text one,
    decoded in one batch) answer with their references' greedy text; then the text
    request's conversation goes on (a fixed answer, then a picture): it resumes from the
    cached prefix (the linear layers' snapshot at the end of the first prompt) and answers
    as transformers does for the whole conversation. (A picture cut into slices has
    several placeholder runs, which the prefix cache keys by all of a request's images,
    so a turn that adds a picture shares only the text before the first one.)"""
    from server_harness import png_data_url
    from server_harness import user as server_user
    from server_process import ServerProcess

    _, processor = loaded(FAMILY, "hub")
    conversation, (picture,) = CASES["image_in_second_turn"]
    requests = {"one_image": [server_user("Describe this image.", png_data_url(IMAGE_A))],
                "first_turn": [conversation[0]]}
    with ServerProcess("--model", str(tiny_checkpoints.path(FAMILY, "hub")),
                       "--served-model-name", "tiny", env=entry_point_env()) as server:
        client = server.openai_client()

        def ask(messages):
            return client.chat.completions.create(model="tiny", messages=messages,
                                                  max_tokens=NEW_TOKENS, temperature=0.0)

        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(requests, pool.map(ask, requests.values())))
        later = ask([*conversation[:2], server_user("What is in this picture?", png_data_url(picture))])
    expected = greedy_text(processor, reference(FAMILY, "one_image"))
    assert answers["one_image"].choices[0].message.content == expected
    assert later.choices[0].message.content == greedy_text(
        processor, reference(FAMILY, "image_in_second_turn"))
    first_prompt = answers["first_turn"].usage.prompt_tokens
    assert later.usage.prompt_tokens_details.cached_tokens >= first_prompt


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_wrong_insert_layer_would_be_caught(tiny_checkpoints, loaded, reference):
    """The window merger after another block changes the image tokens' logits."""
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    config["insert_layer_id"] = 2
    model, processor = loaded(FAMILY, "hub")
    assert_wrong_model_is_caught(minicpmv4_6.Model.from_config(config), model, processor,
                                 CASES["one_image"], reference(FAMILY, "one_image"))


def test_another_window_order_would_be_caught(monkeypatch, loaded, reference):
    """Windows taken column by column instead of row by row change the logits."""
    model, processor = loaded(FAMILY, "hub")
    merger = model.vit_merger
    original = type(merger).windows

    def column_major(self, x, rows, columns):
        w = self.window
        return original(self, x.reshape(rows, columns, -1).transpose(1, 0, 2).reshape(1, -1, x.shape[-1]),
                        columns, rows)

    monkeypatch.setattr(type(merger), "windows", column_major)
    with no_feature_cache():
        _, logits = our_logits(model, processor, *CASES["one_image"])
    assert np.abs(logits - reference(FAMILY, "one_image").logits).max() > CAUGHT


# -------------------------------------------------------------- checkpoints and names


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    # The Hub's config names its multi-token-prediction head; transformers' drops it.
    assert hub.text.mtp_num_hidden_layers == 1 and new.text.mtp_num_hidden_layers == 0
    assert replace(hub, text=replace(hub.text, mtp_num_hidden_layers=0)) == new
    assert hub.text.layer_types == ("linear_attention", "full_attention") * 2


def test_sanitized_names_are_mlx_community_names(tiny_checkpoints, loaded):
    """Both layouts map onto mlx-vlm's names for MiniCPM-V 4.6 (the window merger beside
    the tower, ``vit_merger.*``), the patch convolution channels-last."""
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        weights = mx.load(str(tiny_checkpoints.path(FAMILY, layout) / "model.safetensors"))
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        assert minicpmv4_6.is_hf_checkpoint(weights.keys())
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected
        assert sanitized["vision_tower.embeddings.patch_embedding.weight"].shape == (32, 4, 4, 3)
    for name in (
        "vision_tower.embeddings.position_embedding.weight",
        "vision_tower.encoder.layers.1.self_attn.q_proj.weight",
        "vit_merger.self_attn.out_proj.bias",
        "vit_merger.pre_norm.weight",
        "vit_merger.linear_2.weight",
        "vision_tower.post_layernorm.weight",
        "merger.mlp.0.pre_norm.weight",
        "merger.mlp.0.linear_2.weight",
        "language_model.model.layers.0.linear_attn.conv1d.weight",
        "language_model.lm_head.weight",
    ):
        assert name in expected, name


def test_an_mlx_layout_checkpoint_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    model, _ = loaded(FAMILY, "hub")
    mlx_model, processor = load(save_as_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path))
    _, logits = our_logits(mlx_model, processor, *CASES["two_images"])
    np.testing.assert_allclose(logits, reference(FAMILY, "two_images").logits, rtol=0,
                               atol=LOGITS_ATOL)
