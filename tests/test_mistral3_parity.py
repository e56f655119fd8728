"""Mistral 3 and Pixtral (LLaVA layout) against transformers (float32), on tiny checkpoints.

Both families load from both config layouts (transformers 5's and the Hub's, see
tests/tiny/pixtral.py) through ``mlxvlm.load``. The reference runs transformers' own
``PixtralProcessor`` (imported for the test, see ``transformers_processor``) and model;
mlxvlm runs its torch-free processor, which must give identical prompt ids and pixels;
first-pass logits within 1e-4, greedy tokens equal for 24 steps — text only, one image, two images
of different sizes (padded into one batch, each run at its own size), an image in a later
turn. Guards: another image changes the output, wrong rope θs are caught, margins are
not razor-thin.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from parity import (
    LOGITS_ATOL,
    assert_another_image_changes_the_output,
    assert_patch_weight_is_channels_last,
    assert_wrong_model_is_caught,
    load_transformers_model,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    our_logits,
    our_tokens,
    parameter_list,
    processor_inputs,
    read_config,
    reference_fixture,
    standard_cases,
    standard_parity_tests,
)
from tiny import make_image
from tiny.pixtral import FAMILIES, LAYOUTS, llava_config, transformers_processor
from mlxvlm.checkpoint.loading import load_weights_files
from mlxvlm.models import get_family, pixtral
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

IMAGE_A = make_image(112, 84, seed=1)
IMAGE_B = make_image(84, 56, seed=2)
IMAGE_A2 = make_image(112, 84, seed=3)

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_B, IMAGE_A2)
FAMILY_LAYOUTS = [(f, layout) for f in FAMILIES for layout in LAYOUTS]

# (family, case) -> parity.Reference, with transformers' own PixtralProcessor.
reference = reference_fixture(transformers_processor)


def reference_inputs(tiny, case: str) -> dict:
    """transformers' PixtralProcessor's outputs for a case (numpy)."""
    return dict(processor_inputs(transformers_processor(tiny), *ALL_CASES[case], return_tensors="np"))


def tokens(model, processor, case: str, **options) -> list[int]:
    return our_tokens(model, processor, *ALL_CASES[case], **options)


# ----------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_processor_matches_transformers(family, case, tiny_checkpoints, loaded):
    """mlxvlm's torch-free processor gives transformers' PixtralProcessor's exact inputs."""
    model, processor = loaded(family, "hub")
    expected = reference_inputs(tiny_checkpoints.model(family), case)
    messages, images = ALL_CASES[case]
    inputs = prepare_inputs(processor, messages, images, feature_names=model.feature_names)
    assert inputs.input_ids[0].tolist() == expected["input_ids"][0].tolist()
    assert set(inputs.features) == ({"pixel_values", "image_sizes"} if images else set())
    for name, value in inputs.features.items():
        np.testing.assert_array_equal(np.array(value), expected[name])


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests(FAMILY_LAYOUTS, CASES)
)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_gives_the_same_tokens(family, loaded, reference):
    model, processor = loaded(family, "hub")
    assert tokens(model, processor, "two_images", prefill_step_size=3) == (
        reference(family, "two_images").tokens
    )


def test_llava_config_builds_the_pixtral_model(tiny_checkpoints, reference):
    """The Hub's pixtral-12b says ``model_type: llava``: ``pixtral.Model`` reads that config
    and weights unchanged (what llava.py delegates to for a Pixtral tower)."""
    path = tiny_checkpoints.path("pixtral", "hub")
    assert pixtral.is_pixtral_config(llava_config(path))
    model = pixtral.Model.from_config(llava_config(path))
    weights = load_weights_files(path)
    assert pixtral.is_hf_checkpoint(weights)
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    processor = pixtral.load_processor(path, llava_config(path))
    _, logits = our_logits(model, processor, *ALL_CASES["two_images"])
    np.testing.assert_allclose(logits, reference("pixtral", "two_images").logits, rtol=0, atol=LOGITS_ATOL)


# ---------------------------------------------------------------- the tests can fail


@pytest.mark.parametrize("family", FAMILIES)
def test_another_image_changes_the_output(family, loaded, reference):
    model, processor = loaded(family, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, family, reference)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sub_config", ["text_config", "vision_config"])
def test_wrong_rope_theta_would_be_caught(family, sub_config, tiny_checkpoints, loaded, reference):
    """Both θs differ from the defaults, so a loader reading the wrong key fails parity."""
    config = read_config(tiny_checkpoints, family, "hub")
    del config[sub_config]["rope_theta"]
    model, processor = loaded(family, "hub")
    assert_wrong_model_is_caught(get_family(family).Model.from_config(config), model, processor,
                                 CASES["one_image"], reference(family, "one_image"))


# -------------------------------------------------------------- checkpoints and names


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_layout_reads_the_same_in_transformers(family, tiny_checkpoints, reference, tmp_path):
    """The Hub-layout fixture is faithful: transformers reads it into the same model
    (pixtral: with the Hub's own ``llava`` model_type)."""
    path = tmp_path / "hub"
    shutil.copytree(tiny_checkpoints.path(family, "hub"), path)
    if family == "pixtral":
        (path / "config.json").write_text(json.dumps(llava_config(path)))
    model = load_transformers_model(path)
    inputs = reference_inputs(tiny_checkpoints.model(family), "two_images")
    with torch.no_grad():
        logits = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).logits[0].numpy()
    np.testing.assert_array_equal(logits, reference(family, "two_images").logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_both_config_layouts_build_the_same_model(family, tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, family)
    assert hub == new
    assert (new.text.rope_theta, new.vision.rope_theta) == (5000.0, 500.0)
    assert not new.text.tie_word_embeddings and new.text.head_dim == 32


@pytest.mark.parametrize("family", FAMILIES)
def test_sanitized_names_are_mlx_community_names(family, tiny_checkpoints, loaded):
    module = get_family(family)
    model, _ = loaded(family, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        weights = load_weights_files(tiny_checkpoints.path(family, layout))
        assert module.is_hf_checkpoint(weights.keys())
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected
        assert not module.is_hf_checkpoint(sanitized.keys())
    assert_patch_weight_is_channels_last(
        sanitized, "vision_tower.vision_model.patch_conv.weight", model.args.vision
    )
    names = [
        "vision_tower.vision_model.ln_pre.weight",
        "vision_tower.vision_model.transformer.layers.1.attention.q_proj.weight",
        "vision_tower.vision_model.transformer.layers.1.feed_forward.gate_proj.weight",
        "vision_tower.vision_model.transformer.layers.1.attention_norm.weight",
        "multi_modal_projector.linear_1.weight",
        "multi_modal_projector.linear_2.weight",
        "language_model.model.layers.1.self_attn.q_proj.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
    ]
    if family == "mistral3":
        names += ["multi_modal_projector.norm.weight",
                  "multi_modal_projector.patch_merger.merging_layer.weight"]
    else:
        names += ["multi_modal_projector.linear_1.bias"]
    for name in names:
        assert name in expected, name


def test_sparse_hub_sub_configs_take_transformers_defaults():
    """mistral-community/pixtral-12b's config.json leaves out what equals the defaults
    (no num_attention_heads in text_config, hardly anything in vision_config)."""
    config = {
        "model_type": "llava", "image_token_index": 10, "projector_hidden_act": "gelu",
        "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
        "text_config": {"hidden_act": "silu", "hidden_size": 5120, "head_dim": 128,
                        "intermediate_size": 14336, "is_composition": True,
                        "max_position_embeddings": 1024000, "model_type": "mistral",
                        "num_hidden_layers": 40, "num_key_value_heads": 8,
                        "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                        "sliding_window": None, "vocab_size": 131072},
        "vision_config": {"head_dim": 64, "hidden_act": "silu", "image_size": 1024,
                          "is_composition": True, "model_type": "pixtral", "patch_size": 16,
                          "rope_theta": 10000.0, "tie_word_embeddings": False},
    }
    args = pixtral.Model.model_args(config)
    assert (args.text.num_attention_heads, args.text.head_dim, args.text.rope_theta) == (32, 128, 1e9)
    assert not args.text.tie_word_embeddings and args.max_context == 1024000
    assert (args.vision.hidden_size, args.vision.num_attention_heads, args.vision.num_hidden_layers) == (1024, 16, 24)
    assert args.vision.hidden_act == "silu" and args.projector_bias
