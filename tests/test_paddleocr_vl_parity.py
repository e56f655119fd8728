"""PaddleOCR-VL against transformers (float32), on a tiny random checkpoint.

Loaded from both config layouts (transformers 5's and PaddlePaddle/PaddleOCR-VL's, see
tests/tiny/paddleocr.py) through ``mlxvlm.load`` and compared with the in-memory
transformers model: logits of the first forward pass and 64 greedy tokens (an OCR model
answers at length from one image) for text only, one image, two images of different
sizes, an image in a later turn and images of other aspect ratios and sizes (the tower
takes each at its own resolution, resampling its position table). Guards: another image
changes the output, the wrong rope θ changes the logits, no greedy step is a near tie.
"""

from __future__ import annotations

import functools
import json

import mlx.core as mx
import numpy as np
import pytest

import parity
from parity import MIN_REFERENCE_MARGIN, parameter_list
from parity import loaded  # noqa: F401 (fixture)
from tiny import make_image
from tiny.paddleocr import LAYOUTS, reference_processor
from mlxvlm.models import get_family

torch = pytest.importorskip("torch")

FAMILY = "paddleocr_vl"
NEW_TOKENS = 64
IMAGE_A = make_image(112, 84, seed=1)  # 6 x 8 patches -> 12 tokens
IMAGE_B = make_image(84, 56, seed=2)  # 4 x 6 patches -> 6 tokens
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content
IMAGE_TALL = make_image(56, 140, seed=4)  # 10 x 4 patches -> 10 tokens
IMAGE_LARGE = make_image(400, 260, seed=5)  # resized down to the processor's pixel limit

CASES, ALL_CASES = parity.standard_cases(IMAGE_A, IMAGE_B, IMAGE_A2)
CASES["tall_image"] = (parity.user(None, "OCR:"), [IMAGE_TALL])
CASES["large_and_tall_images"] = (parity.user(None, None, "Table Recognition:"),
                                  [IMAGE_LARGE, IMAGE_TALL])
ALL_CASES.update(CASES)


@pytest.fixture(scope="session")
def reference(tiny_checkpoints):
    """case -> ``parity.Reference`` with NEW_TOKENS greedy tokens (computed once per
    session: tests/test_paddleocr_vl_serving.py reads them too)."""

    @functools.cache
    def run(case: str) -> parity.Reference:
        tiny = tiny_checkpoints.model(FAMILY)
        messages, images = ALL_CASES[case]
        return parity.reference_run(tiny.model, reference_processor(tiny), messages, images,
                                    new_tokens=NEW_TOKENS)

    return run


def our_tokens(model, processor, case: str, **options) -> list[int]:
    return parity.our_tokens(model, processor, *ALL_CASES[case], max_tokens=NEW_TOKENS, **options)


# ----------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_pass_logits_match_transformers(layout, case, loaded, reference):
    model, processor = loaded(FAMILY, layout)
    parity.assert_first_pass_matches(model, processor, ALL_CASES[case], reference(case))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_64_greedy_tokens_match_transformers(layout, case, loaded, reference):
    model, processor = loaded(FAMILY, layout)
    ref = reference(case)
    assert len(ref.tokens) == NEW_TOKENS, "the reference stopped early; pick another seed"
    assert ref.margin > MIN_REFERENCE_MARGIN, f"top-1/top-2 margin {ref.margin:.2e} is too thin"
    assert our_tokens(model, processor, case) == ref.tokens


def test_decode_steps_match_one_pass(tiny_checkpoints, loaded, reference):
    """Teacher-forced on the 64-token answer, every cached decode step gives the logits
    transformers computes over the whole sequence at once (positions after an image)."""
    model, processor = loaded(FAMILY, "hub")
    tiny = tiny_checkpoints.model(FAMILY)
    # (an answer holding no image placeholder, which transformers would take for an image)
    case = "large_and_tall_images"
    parity.assert_decode_steps_match(tiny.model, model, processor, ALL_CASES[case], reference(case))


def test_chunked_prefill_gives_the_same_tokens(loaded, reference):
    """Chunks of 5 tokens split the images' placeholder runs and their M-RoPE ids."""
    model, processor = loaded(FAMILY, "transformers")
    assert our_tokens(model, processor, "two_images", prefill_step_size=5) == (
        reference("two_images").tokens
    )


def test_prompt_opens_with_the_templates_start_token_only(loaded, reference):
    """The template writes ``<|begin_of_sentence|>``; the tokenizer adds no BOS of its own."""
    _, processor = loaded(FAMILY, "hub")
    tokenizer = processor.tokenizer
    ids = reference("one_image").input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|begin_of_sentence|>")
    assert tokenizer.bos_token_id not in ids


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    other = our_tokens(model, processor, "one_other_image")
    assert other != reference("one_image").tokens
    assert other == reference("one_other_image").tokens


def test_wrong_rope_theta_would_be_caught(tiny_checkpoints, loaded, reference):
    """The fixture's θ is not the default, so a loader reading the wrong key fails parity."""
    config = parity.read_config(tiny_checkpoints, FAMILY, "hub")
    del config["rope_theta"]
    model, processor = loaded(FAMILY, "hub")
    wrong = get_family(FAMILY).Model.from_config(config)
    parity.assert_wrong_model_is_caught(wrong, model, processor, ALL_CASES["image_in_second_turn"],
                                        reference("image_in_second_turn"))


def test_position_table_resampling_would_be_caught(loaded, reference):
    """Corner-aligned resampling (Qwen3-VL's) of the position table instead of
    half-pixel centres changes the logits: the parity cases see the difference."""
    from mlxvlm.models.layers import navit_vision

    model, processor = loaded(FAMILY, "transformers")
    original = navit_vision.bilinear_position_taps
    model.feature_cache.clear()  # the tower must run, not hand back cached features
    try:
        navit_vision.bilinear_position_taps = (
            lambda grid, merge, side, align_corners=True: original(grid, merge, side, True)
        )
        _, logits = parity.our_logits(model, processor, *ALL_CASES["tall_image"])
    finally:
        navit_vision.bilinear_position_taps = original
        model.feature_cache.clear()
    assert np.abs(logits - reference("tall_image").logits).max() > parity.CAUGHT


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it into the same model
    (it ties the head although the config says false), with the same processor."""
    messages, images = ALL_CASES["one_image"]
    for layout in LAYOUTS:
        path = tiny_checkpoints.path(FAMILY, layout)
        model = parity.load_transformers_model(path)
        assert model.config.tie_word_embeddings
        processor = get_family(FAMILY).load_processor(path, {})
        logits = parity.transformers_logits(model, processor, messages, images)
        np.testing.assert_array_equal(logits, reference("one_image").logits)


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, transformers_layout = parity.model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == transformers_layout
    assert hub.text.head_dim == 32 and hub.text.head_dim * 4 != hub.text.hidden_size
    assert hub.tie_word_embeddings


def test_sanitized_names_are_mlx_community_names(tiny_checkpoints, loaded):
    """Both Hugging Face namings map onto the names mlx-community's conversions use."""
    module = get_family(FAMILY)
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        weights = mx.load(str(tiny_checkpoints.path(FAMILY, layout) / "model.safetensors"))
        assert module.is_hf_checkpoint(weights.keys())
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected
        assert not module.is_hf_checkpoint(sanitized.keys())
    for name in (
        "visual.embeddings.patch_embedding.weight",
        "visual.embeddings.position_embedding.weight",
        "visual.layers.1.self_attn.qkv.weight",
        "visual.layers.1.self_attn.out_proj.bias",
        "visual.layers.1.mlp.fc2.weight",
        "visual.post_layernorm.weight",
        "visual.projector.pre_norm.weight",
        "visual.projector.linear_1.weight",
        "visual.projector.linear_2.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.1.self_attn.o_proj.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
    ):
        assert name in expected, name
    v = model.args.vision
    assert sanitized["visual.embeddings.patch_embedding.weight"].shape == (
        v.hidden_size, v.patch_size, v.patch_size, v.num_channels
    )


def test_mlx_community_checkpoint_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    """A checkpoint in mlx-community's names and layout (fused q/k/v, channels-last patch
    convolution, the tied head stored) loads without renaming and gives the same logits."""
    from mlxvlm import load

    model, _ = loaded(FAMILY, "hub")
    source = tiny_checkpoints.path(FAMILY, "hub")
    path = parity.save_as_mlx_checkpoint(model, source, tmp_path / "mlx")
    assert "language_model.lm_head.weight" in mx.load(str(path / "model.safetensors"))
    converted, processor = load(path)
    parity.assert_first_pass_matches(converted, processor, ALL_CASES["two_images"],
                                     reference("two_images"))


def test_hub_config_says_untied(tiny_checkpoints):
    """The fixture keeps the Hub's contradiction that the loader must resolve as
    transformers does."""
    config = json.loads((tiny_checkpoints.path(FAMILY, "hub") / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "text_config" not in config
