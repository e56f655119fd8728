"""InternVL (transformers' native layout) against transformers (float32), on tiny random
checkpoints (tests/tiny/internvl.py) in both layouts.

Through ``mlxvlm.load``: first-pass logits and 24 greedy tokens for text only, one
image (2 x 2 tiles and a thumbnail), two images (that one and a wide one: 3 x 1 tiles
and a thumbnail) and an image in a later turn; the RMSNorm/q-k-norm tower of the largest
sizes on the image cases; the Qwen3-MoE text model of InternVL3.5-30B-A3B (experts one
tensor each as the Hub stores them, or fused as transformers 5 holds them); a video (frames as tiles, sampled as transformers' processor
samples them); the CLI and the server entry points (two concurrent requests batched,
then a later turn with a new picture that reuses the cached prefix); checkpoints in
mlx-community's names. Guards check that the tests can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

from av_media import coloured_frames, write_video
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
    load_transformers_model,
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
    transformers_logits,
    user,
)
from tiny import make_image
from tiny.internvl import HUB_SAMPLING, LAYOUTS, TOKENS_PER_TILE, reference_processor
from mlxvlm import load
from mlxvlm.models import internvl
from mlxvlm.models.feature_cache import no_feature_cache
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

FAMILY = "internvl"
RMS = "internvl_rms"  # the InternViT-6B-like tower
INTERNVL3 = "internvl3"  # a Qwen2 text model with an untied head
MOE = "internvl_moe"  # a Qwen3-MoE text model (InternVL3.5-30B-A3B, -241B-A28B)
IMAGE_A = make_image(80, 56, seed=1)  # 2 x 2 tiles of 32 + a thumbnail
IMAGE_WIDE = make_image(120, 40, seed=2)  # 3 x 1 tiles + a thumbnail
IMAGE_A2 = make_image(80, 56, seed=8)  # A's size, other content (and answer)
IMAGE_NEXT = make_image(50, 70, seed=6)  # the later turn's picture

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_WIDE, IMAGE_A2)
IMAGE_CASES = ("one_image", "two_images")

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


@pytest.mark.parametrize("case", IMAGE_CASES)
def test_rms_norm_tower_with_qk_norm_matches_transformers(case, loaded, reference):
    model, processor = loaded(RMS, "hub")
    assert model.args.vision.use_qk_norm and model.args.vision.norm_type == "rms_norm"
    assert_first_pass_matches(model, processor, CASES[case], reference(RMS, case))
    assert_greedy_tokens_match(model, processor, CASES[case], reference(RMS, case))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["text", "one_image", "image_in_second_turn"])
def test_qwen2_text_model_with_an_untied_head_matches_transformers(layout, case, loaded, reference):
    """InternVL3's -hf layout: Qwen2 (biased q/k/v) through mlx-lm, its own output head
    (``lm_head.weight`` in the Hub's names, ``language_model.lm_head`` in ours)."""
    model, processor = loaded(INTERNVL3, layout)
    assert not model.args.text.tie_word_embeddings and "lm_head" in model.language_model
    assert_first_pass_matches(model, processor, CASES[case], reference(INTERNVL3, case))
    assert_greedy_tokens_match(model, processor, CASES[case], reference(INTERNVL3, case))


# ----------------------------------------------------------------- mixture of experts


@pytest.mark.parametrize("layout, case", [("hub", "text"), ("hub", "one_image"),
                                          ("hub", "two_images"), ("hub", "image_in_second_turn"),
                                          ("transformers", "one_image")])
def test_qwen3_moe_text_model_matches_transformers(layout, case, loaded, reference):
    """InternVL3.5-30B-A3B's shape: mlx-lm's Qwen3-MoE (2 of 4 experts a token, layer 1
    dense) with the experts stacked from one tensor each (both layouts store them so)."""
    model, processor = loaded(MOE, layout)
    assert model.args.text.model_type == "qwen3_moe" and "switch_mlp" in model.layers[0].mlp
    assert_first_pass_matches(model, processor, CASES[case], reference(MOE, case))
    assert_greedy_tokens_match(model, processor, CASES[case], reference(MOE, case))


def test_fused_expert_tensors_map_as_the_hubs(tiny_checkpoints, loaded):
    """transformers 5's in-memory layout (``mlp.experts.gate_up_proj`` (experts, 2 x
    width, hidden), ``down_proj``) and the Hub's one tensor per expert sanitize to the
    same mlx-lm ``switch_mlp`` weights, expert by expert."""
    model, _ = loaded(MOE, "hub")
    fused = {name: mx.array(value.numpy())
             for name, value in tiny_checkpoints.model(MOE).model.state_dict().items()}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in fused
    hub = mx.load(str(tiny_checkpoints.path(MOE, "hub") / "model.safetensors"))
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in hub
    from_fused, from_hub = model.sanitize(fused), model.sanitize(hub)
    assert set(from_fused) == set(from_hub) == {name for name, _ in parameter_list(model)}
    for name, value in from_hub.items():
        np.testing.assert_array_equal(np.array(from_fused[name]), np.array(value), err_msg=name)
    up = np.array(from_hub["language_model.model.layers.0.mlp.switch_mlp.up_proj.weight"])
    np.testing.assert_array_equal(
        up[3], np.array(hub["model.language_model.layers.0.mlp.experts.3.up_proj.weight"]))


def test_unrenormalized_routing_would_be_caught(tiny_checkpoints, loaded, reference):
    """The fixture renormalizes its top-2 routing weights (``norm_topk_prob``, as the
    30B-A3B does): a model that reads it wrong fails parity."""
    config = read_config(tiny_checkpoints, MOE, "hub")
    config["text_config"]["norm_topk_prob"] = False
    model, processor = loaded(MOE, "hub")
    assert_wrong_model_is_caught(internvl.Model.from_config(config), model, processor,
                                 CASES["one_image"], reference(MOE, "one_image"))


def test_a_gpt_oss_text_model_is_refused(tiny_checkpoints):
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    config["text_config"] = {**config["text_config"], "model_type": "gpt_oss",
                             "num_local_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(NotImplementedError, match="gpt_oss mixture-of-experts"):
        internvl.Model.from_config(config)


def test_the_cases_cover_tiles_and_thumbnails(loaded, reference):
    """A's 2 x 2 tiles and the wide one's 3 x 1, each with a thumbnail, 16 tokens a tile,
    each image between <img> and </img>."""
    _, processor = loaded(FAMILY, "hub")
    tokens = processor.tokenizer.convert_tokens_to_ids
    ids = reference(FAMILY, "two_images").input_ids
    assert ids.count(tokens("<IMG_CONTEXT>")) == (5 + 4) * TOKENS_PER_TILE
    assert ids.count(tokens("<img>")) == ids.count(tokens("</img>")) == 2


def test_decode_steps_match_transformers(tiny_checkpoints, loaded, reference):
    """Teacher-forced on the reference's answer (one without <IMG_CONTEXT> tokens: the
    random model writes some elsewhere, which the one-pass reference would take for
    image placeholders), every decode step gives transformers' logits."""
    model, processor = loaded(FAMILY, "hub")
    ref = reference(FAMILY, "image_in_second_turn")
    assert model.args.image_token_id not in ref.tokens
    assert_decode_steps_match(tiny_checkpoints.model(FAMILY).model, model, processor,
                              CASES["image_in_second_turn"], ref)


def test_batched_generation_gives_each_prompt_its_tokens(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_batched_tokens_match(model, processor, CASES, [reference(FAMILY, c) for c in CASES])


@pytest.mark.parametrize("family", [FAMILY, MOE])
def test_sampling_defaults_come_from_generation_config(family, loaded):
    _, processor = loaded(family, "hub")
    assert processor.sampling_defaults.values == HUB_SAMPLING


# ----------------------------------------------------------------------------- video


@pytest.fixture(scope="module")
def video_file(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("videos") / "clip.mp4",
                       coloured_frames(40, 96, 64, seed=21), fps=10)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_video_matches_transformers(layout, tiny_checkpoints, loaded, video_file):
    """A 4 s clip at 1 fps: four frames, each a tile after its "FrameN:" label, the
    frames (resized by torchvision's bicubic filter) and the logits and greedy tokens
    transformers' processor and model give."""
    from video_reference import transformers_inputs

    model, processor = loaded(FAMILY, layout)
    messages = [{"role": "user", "content": [{"type": "video", "video": str(video_file)},
                                             {"type": "text", "text": "What is shown here?"}]}]
    batch = transformers_inputs(tiny_checkpoints.path(FAMILY, layout), messages, fps=1,
                                do_sample_frames=True)
    inputs = prepare_inputs(processor, messages, feature_names=model.feature_names,
                            video_options={"fps": 1})
    assert inputs.input_ids[0].tolist() == batch["input_ids"][0].tolist()
    assert batch["pixel_values"].shape[0] == 4
    np.testing.assert_array_equal(np.array(inputs.features["pixel_values"]),
                                  batch["pixel_values"].numpy())
    reference_model = tiny_checkpoints.model(FAMILY).model
    with torch.no_grad():
        expected = reference_model(**batch).logits[0].numpy()
        out = reference_model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                                       return_dict_in_generate=True)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = np.array(model(inputs.input_ids, model.make_cache(), embeddings=embeddings)[0])
    np.testing.assert_allclose(logits, expected, rtol=0, atol=LOGITS_ATOL)
    tokens = our_tokens(model, processor, messages, [], fps=1)
    assert tokens == out.sequences[0, batch["input_ids"].shape[1]:].tolist()


# ----------------------------------------------------------------------- entry points


def entry_point_env() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MLXVLM_ALLOW_TORCH", None)  # as a user's process runs: torch-free
    return env


@pytest.mark.parametrize("family", [FAMILY, MOE])
def test_cli_answers_with_the_reference_tokens(family, tmp_path, tiny_checkpoints, loaded,
                                               reference):
    """``python -m mlxvlm.generate`` on the Hub layout prints transformers' greedy answer."""
    _, processor = loaded(family, "hub")
    ref = reference(family, "one_image")
    assert_reference_is_decisive(ref)
    picture = tmp_path / "a.png"
    IMAGE_A.save(picture)
    result = subprocess.run(
        [sys.executable, "-m", "mlxvlm.generate", "--model", str(tiny_checkpoints.path(family, "hub")),
         "--image", str(picture), "--prompt", "Describe this image.",
         "--max-tokens", str(NEW_TOKENS), "--temperature", "0"],
        capture_output=True, env=entry_point_env(), timeout=300,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    # bytes: a random model's text may hold a carriage return, which text mode rewrites
    assert result.stdout.decode() == greedy_text(processor, ref) + "\n"


@pytest.mark.parametrize("entry_point", ["mlxvlm.generate", "mlxvlm.server"])
def test_the_original_internvl_chat_layout_is_refused_in_one_line(entry_point, tmp_path):
    """``OpenGVLab/InternVL3_5-*`` without -HF (remote code, ``llm_config``): the CLI and
    the server stop with one line that points to the -HF checkpoint."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "internvl_chat", "architectures": ["InternVLChatModel"],
        "llm_config": {"model_type": "qwen3"}, "vision_config": {"model_type": "intern_vit_6b"},
        "template": "internvl2_5", "downsample_ratio": 0.5,
    }))
    prompt = ["--prompt", "Hi"] if entry_point == "mlxvlm.generate" else []
    result = subprocess.run(
        [sys.executable, "-m", entry_point, "--model", str(tmp_path), *prompt],
        capture_output=True, text=True, env=entry_point_env(), timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model_type 'internvl_chat'"), lines
    assert "-HF checkpoint" in lines[0]


@pytest.mark.parametrize("family", [FAMILY, MOE])
def test_server_batches_requests_and_reuses_a_turns_prefix(family, tiny_checkpoints, loaded,
                                                           reference):
    """``python -m mlxvlm.server``: two requests at once (an image one and a text one,
    decoded in one batch) answer with their references' greedy text; then a later turn
    (the first image's conversation, its answer and a new picture) reuses the cached
    prefix and answers as transformers does for the whole conversation."""
    from server_harness import png_data_url
    from server_harness import user as server_user
    from server_process import ServerProcess

    _, processor = loaded(family, "hub")
    first_turn = [server_user("Describe this image.", png_data_url(IMAGE_A))]
    requests = {"one_image": first_turn,
                "text": [{"role": "user", "content": CASES["text"][0][0]["content"]}]}
    with ServerProcess("--model", str(tiny_checkpoints.path(family, "hub")),
                       "--served-model-name", "tiny", env=entry_point_env()) as server:
        client = server.openai_client()

        def ask(messages):
            return client.chat.completions.create(model="tiny", messages=messages,
                                                  max_tokens=NEW_TOKENS, temperature=0.0)

        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(requests, pool.map(ask, requests.values())))
        for case, answer in answers.items():
            assert answer.choices[0].message.content == greedy_text(processor, reference(family, case))

        said = answers["one_image"].choices[0].message.content
        later = [*first_turn, {"role": "assistant", "content": said},
                 server_user("And this one?", png_data_url(IMAGE_NEXT))]
        answer = ask(later)
    messages = [*user(None, "Describe this image."), {"role": "assistant", "content": said},
                *user(None, "And this one?")]  # server_user puts images first
    expected = reference_run(tiny_checkpoints.model(family).model,
                             reference_processor(tiny_checkpoints.model(family)),
                             messages, [IMAGE_A, IMAGE_NEXT])
    assert answer.choices[0].message.content == greedy_text(processor, expected)
    first_prompt = answers["one_image"].usage.prompt_tokens
    assert answer.usage.prompt_tokens_details.cached_tokens >= first_prompt


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_wrong_rope_theta_would_be_caught(tiny_checkpoints, loaded, reference):
    """The fixture's θ is not Qwen3's default, so reading the wrong key fails parity."""
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    del config["text_config"]["rope_theta"]
    model, processor = loaded(FAMILY, "hub")
    assert_wrong_model_is_caught(internvl.Model.from_config(config), model, processor,
                                 CASES["one_image"], reference(FAMILY, "one_image"))


def test_another_pixel_shuffle_order_would_be_caught(monkeypatch, loaded, reference):
    """Squares folded with their patches column by column instead of row by row change
    the image tokens' logits."""
    model, processor = loaded(FAMILY, "hub")

    def column_major(patches, rows, columns, factor):
        tiles, _, D = patches.shape
        blocks = patches.reshape(tiles, rows // factor, factor, columns // factor, factor, D)
        return blocks.transpose(0, 1, 3, 4, 2, 5).reshape(tiles, -1, factor * factor * D)

    monkeypatch.setattr(internvl, "pixel_shuffle", column_major)
    with no_feature_cache():  # features of the patched model must not be kept
        _, logits = our_logits(model, processor, *CASES["one_image"])
    assert np.abs(logits - reference(FAMILY, "one_image").logits).max() > CAUGHT


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads both into the same model."""
    ref = reference(FAMILY, "two_images")
    processor = reference_processor(tiny_checkpoints.model(FAMILY))
    for layout in LAYOUTS:
        model = load_transformers_model(tiny_checkpoints.path(FAMILY, layout))
        logits = transformers_logits(model, processor, *CASES["two_images"])
        np.testing.assert_array_equal(logits, ref.logits)


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == new
    assert hub.text.rope_theta == 7_000.0 and hub.image_seq_length == TOKENS_PER_TILE


def test_sanitized_names_are_mlx_community_names(tiny_checkpoints, loaded):
    """Both layouts map onto the names mlx-vlm's InternVL port gives (transformers'
    module names without ``model.``; the text model under ``language_model.model``),
    the patch convolution channels-last."""
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        weights = mx.load(str(tiny_checkpoints.path(FAMILY, layout) / "model.safetensors"))
        assert internvl.is_hf_checkpoint(weights.keys())
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected
        patch = sanitized["vision_tower.embeddings.patch_embeddings.projection.weight"]
        assert patch.shape == (32, 4, 4, 3)
    for name in (
        "vision_tower.embeddings.cls_token",
        "vision_tower.embeddings.position_embeddings",
        "vision_tower.encoder.layer.1.attention.q_proj.bias",
        "vision_tower.encoder.layer.1.attention.projection_layer.weight",
        "vision_tower.encoder.layer.1.layernorm_before.weight",
        "vision_tower.encoder.layer.1.lambda_1",
        "vision_tower.encoder.layer.1.mlp.fc2.weight",
        "multi_modal_projector.layer_norm.weight",
        "multi_modal_projector.linear_1.weight",
        "multi_modal_projector.linear_2.bias",
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.1.self_attn.q_norm.weight",
        "language_model.model.norm.weight",
    ):
        assert name in expected, name


def test_rms_tower_names(loaded):
    model, _ = loaded(RMS, "hub")
    names = {name for name, _ in parameter_list(model)}
    assert "vision_tower.encoder.layer.0.attention.q_norm.weight" in names
    assert "vision_tower.encoder.layer.0.attention.q_proj.bias" not in names


@pytest.mark.parametrize("family", [FAMILY, MOE])
def test_an_mlx_layout_checkpoint_loads_unchanged(family, tmp_path, tiny_checkpoints, loaded,
                                                  reference):
    """Our names (mlx-lm's ``switch_mlp`` for the experts) load as they are."""
    model, _ = loaded(family, "hub")
    mlx_model, processor = load(save_as_mlx_checkpoint(model, tiny_checkpoints.path(family, "hub"), tmp_path))
    _, logits = our_logits(mlx_model, processor, *CASES["two_images"])
    np.testing.assert_allclose(logits, reference(family, "two_images").logits, rtol=0,
                               atol=LOGITS_ATOL)


def test_a_tokenizer_without_the_image_tokens_is_refused(tmp_path, tiny_checkpoints):
    """InternVL's processor reads its tokens off the tokenizer: one that does not name
    them is a clear error at load, not an AttributeError mid-request."""
    import shutil

    path = tmp_path / "no-image-tokens"
    shutil.copytree(tiny_checkpoints.path(FAMILY, "hub"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    for name in ("extra_special_tokens", "start_image_token", "end_image_token",
                 "context_image_token", "video_token"):
        config.pop(name, None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="context_image_token"):
        internvl.load_processor(path, read_config(tiny_checkpoints, FAMILY, "hub"))
