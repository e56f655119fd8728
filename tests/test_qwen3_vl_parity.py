"""Qwen3-VL and Qwen3-VL-MoE against transformers (float32), on tiny random checkpoints.

Both families load from both config layouts (transformers 5's and the Hub's, see
tests/tiny/qwen.py) through ``mlxvlm.load`` and are compared with the in-memory
transformers model the checkpoint was saved from: first-pass logits, and greedy tokens
through ``mlxvlm.stream_generate`` for text only, one image, two images of different
sizes and an image in a later turn. Guards check that the tests can fail: another image
changes the output, DeepStack and interleaved M-RoPE change the logits, a wrong rope θ
is caught, and the reference's greedy steps are not decided by razor-thin margins.
"""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest

from parity import (
    LOGITS_ATOL,
    assert_another_image_changes_the_output,
    assert_rotating_cache_keeps_the_prompt,
    assert_wrong_model_is_caught,
    embedded,
    first_pass,
    load_transformers_model,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    our_tokens,
    parameter_list,
    read_config,
    reference,  # noqa: F401 (fixture)
    standard_cases,
    standard_parity_tests,
    transformers_logits,
)
from tiny import make_image
from tiny.qwen import LAYOUTS, QWEN3_FAMILIES
from mlxvlm.models import get_family

torch = pytest.importorskip("torch")

IMAGE_A = make_image(112, 84, seed=1)  # 6 x 8 patches of 16 px -> 12 tokens
IMAGE_B = make_image(84, 56, seed=2)  # 4 x 6 patches -> 6 tokens
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_B, IMAGE_A2)
FAMILY_LAYOUTS = [(f, layout) for f in QWEN3_FAMILIES for layout in LAYOUTS]


def tokens(model, processor, case: str, **options) -> list[int]:
    return our_tokens(model, processor, *ALL_CASES[case], **options)


# ----------------------------------------------------------------------------------- parity


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests(FAMILY_LAYOUTS, CASES)
)


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_chunked_prefill_splits_deepstack_and_positions(family, loaded, reference):
    """Chunks of 3 tokens cut through the images' runs: each chunk must inject exactly its
    own DeepStack rows at its own M-RoPE positions."""
    model, processor = loaded(family, "hub")
    assert tokens(model, processor, "two_images", prefill_step_size=3) == (
        reference(family, "two_images").tokens
    )


def test_rotating_cache_keeps_positions(loaded, reference):
    model, processor = loaded("qwen3_vl", "transformers")
    assert_rotating_cache_keeps_the_prompt(model, processor, CASES["one_image"],
                                           reference("qwen3_vl", "one_image"))


# ---------------------------------------------------------------- the tests can fail


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_another_image_changes_the_output(family, loaded, reference):
    model, processor = loaded(family, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, family, reference)


def test_deepstack_and_interleaving_matter(loaded, reference):
    """Dropping DeepStack, or M-RoPE in blocked sections, moves the logits far from the
    reference: the parity above exercises both."""
    model, processor = loaded("qwen3_vl", "transformers")
    ref_logits = reference("qwen3_vl", "two_images").logits
    input_ids, embeddings, state = embedded(model, processor, *CASES["two_images"])
    assert state.deepstack is not None and len(state.deepstack.layers) == 2
    without = dataclasses.replace(state, deepstack=None)
    assert np.abs(first_pass(model, input_ids, embeddings, without) - ref_logits).max() > 0.1

    config = json.loads(json.dumps(dict(model.config)))
    blocked = get_family("qwen3_vl").Model.from_config(config)
    blocked.language_model.model.rotary.axis_of_frequency = mx.array(
        [i % 3 for i, size in enumerate(blocked.args.text.mrope_section) for _ in range(size)]
    )
    blocked.load_weights(parameter_list(model))
    assert np.abs(first_pass(blocked, input_ids, embeddings, state) - ref_logits).max() > 0.1


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_wrong_rope_theta_would_be_caught(family, tiny_checkpoints, loaded, reference):
    config = read_config(tiny_checkpoints, family, "hub")
    del config["text_config"]["rope_theta"]  # what a loader reading rope_parameters sees
    model, processor = loaded(family, "hub")
    assert_wrong_model_is_caught(get_family(family).Model.from_config(config), model, processor,
                                 CASES["image_in_second_turn"], reference(family, "image_in_second_turn"))


# -------------------------------------------------------------- checkpoints and names


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_hub_layout_reads_the_same_in_transformers(family, tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it into the same model."""
    path = tiny_checkpoints.path(family, "hub")
    processor = get_family(family).load_processor(path, {})
    logits = transformers_logits(load_transformers_model(path), processor, *CASES["one_image"])
    np.testing.assert_array_equal(logits, reference(family, "one_image").logits)


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_both_config_layouts_build_the_same_model(family, tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, family)
    assert hub == new
    assert new.text.mrope_interleaved and new.text.qk_norm and new.text.head_dim == 32
    assert new.text.rope_theta == 5000.0


@pytest.mark.parametrize("family", QWEN3_FAMILIES)
def test_sanitized_names_are_mlx_community_names(family, tiny_checkpoints, loaded):
    module = get_family(family)
    model, _ = loaded(family, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        path = tiny_checkpoints.path(family, layout)
        weights = mx.load(str(path / "model.safetensors"))
        assert module.is_hf_checkpoint(weights.keys())
        layout_model = module.Model.from_config(read_config(tiny_checkpoints, family, layout))
        sanitized = layout_model.sanitize(weights)
        assert set(sanitized) == expected
        assert not module.is_hf_checkpoint(sanitized.keys())
    names = [
        "vision_tower.patch_embed.proj.bias",
        "vision_tower.pos_embed.weight",
        "vision_tower.blocks.1.mlp.linear_fc1.weight",
        "vision_tower.merger.norm.weight",
        "vision_tower.merger.linear_fc2.weight",
        "vision_tower.deepstack_merger_list.1.linear_fc1.weight",
        "language_model.model.layers.0.self_attn.q_norm.weight",
        "language_model.model.norm.weight",
    ]
    if family == "qwen3_vl_moe":
        names += [
            "language_model.lm_head.weight",
            "language_model.model.layers.0.mlp.gate.weight",
            "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight",
            "language_model.model.layers.0.mlp.switch_mlp.down_proj.weight",
            "language_model.model.layers.1.mlp.gate_proj.weight",  # mlp_only_layers
        ]
    else:
        assert "language_model.lm_head.weight" not in expected  # tied
    for name in names:
        assert name in expected, name


# ------------------------------------------------------------------------ video positions


def test_video_frames_with_timestamps_match_transformers(tiny_checkpoints, loaded):
    """Video input (frame sampling, the video processor) is not wired yet, but the model
    takes video patches: a 2-frame video prompted as Qwen3-VL does — each frame's tokens
    after a "<t seconds>" timestamp — plus an image, fed to both sides."""
    reference_model = tiny_checkpoints.model("qwen3_vl").model
    model, processor = loaded("qwen3_vl", "transformers")
    tok = processor.tokenizer
    start, end = tok.convert_tokens_to_ids("<|vision_start|>"), tok.convert_tokens_to_ids("<|vision_end|>")
    image_pad, video_pad = (tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))
    image_grid, video_grid = [1, 4, 4], [2, 4, 6]  # 4 image tokens; 2 frames of 6 tokens
    ids = tok.encode("Look:") + [start] + [image_pad] * 4 + [end] + tok.encode("Now the clip:")
    for seconds in ("<0.5 seconds>", "<1.5 seconds>"):
        ids += tok.encode(seconds) + [start] + [video_pad] * 6 + [end]
    ids += tok.encode("What happens?")
    rng = np.random.default_rng(0)
    patch = 3 * 2 * 16 * 16
    features = {
        "pixel_values": rng.normal(size=(16, patch)).astype(np.float32),
        "image_grid_thw": np.array([image_grid]),
        "pixel_values_videos": rng.normal(size=(48, patch)).astype(np.float32),
        "video_grid_thw": np.array([video_grid]),
    }
    token_types = [1 if t == image_pad else 2 if t == video_pad else 0 for t in ids]
    with torch.no_grad():
        ref_logits = reference_model(
            input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([token_types]),
            **{k: torch.from_numpy(v) for k, v in features.items()},
        ).logits[0].numpy()
    input_ids = mx.array([ids], dtype=mx.int32)
    embeddings, state = model.embed(input_ids, **{k: mx.array(v) for k, v in features.items()})
    logits = model(input_ids, model.make_cache(), embeddings=embeddings, state=state)
    np.testing.assert_allclose(np.array(logits[0]), ref_logits, rtol=0, atol=LOGITS_ATOL)
