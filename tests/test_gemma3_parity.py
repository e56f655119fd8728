"""Gemma 3 against transformers (float32), on tiny random checkpoints.

The model is loaded from both config layouts (transformers 5's and google/gemma-3-*-it's,
see tests/tiny/gemma3.py) through ``mlxvlm.load`` and compared with the in-memory
transformers model: logits of the first forward pass and greedy tokens through
``mlxvlm.stream_generate``, for text only, one image, two images of different sizes and
an image in a later turn. Every prompt is longer than the 16-token sliding window, and
generation runs past it. Guards check that the tests can fail: another image changes the
output, and dropping the bidirectional attention among image tokens, the sliding window
or the local rope θ changes the logits.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from parity import (
    CAUGHT,
    LOGITS_ATOL,
    NEW_TOKENS,
    assert_another_image_changes_the_output,
    assert_batched_tokens_match,
    assert_decode_steps_match,
    assert_patch_weight_is_channels_last,
    assert_rotating_cache_keeps_the_prompt,
    assert_wrong_model_is_caught,
    embedded,
    first_pass,
    load_transformers_model,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    our_logits,
    our_tokens,
    parameter_list,
    read_config,
    reference,  # noqa: F401 (fixture)
    save_as_mlx_checkpoint,
    standard_cases,
    standard_parity_tests,
    transformers_logits,
)
from tiny import make_image
from tiny.gemma3 import LAYOUTS, SLIDING_WINDOW, hub_weights
from mlxvlm import load
from mlxvlm.models import gemma3

torch = pytest.importorskip("torch")

FAMILY = "gemma3"
IMAGE_A = make_image(112, 84, seed=1)
IMAGE_B = make_image(84, 56, seed=2)
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content

# Every prompt must be longer than the 16-token sliding window.
CASES, ALL_CASES = standard_cases(
    IMAGE_A, IMAGE_B, IMAGE_A2,
    text="Tell me a story about a red cat on a blue mat.",
    two_images=(None, "and", None, "Compare the two images."),
)


def logits_of(model, processor, case):
    return our_logits(model, processor, *ALL_CASES[case])


def tokens_of(model, processor, case, **options):
    return our_tokens(model, processor, *ALL_CASES[case], **options)


# ----------------------------------------------------------------------------------- parity


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests([(FAMILY, layout) for layout in LAYOUTS], CASES)
)


@pytest.mark.parametrize("case", CASES)
def test_every_prompt_outgrows_the_sliding_window(case, reference):
    """(Our prompt ids are the reference's: see the first-pass test.)"""
    assert len(reference(FAMILY, case).input_ids) > SLIDING_WINDOW


def test_decode_steps_match_transformers(tiny_checkpoints, loaded, reference):
    """Teacher-forced on the reference's answer, every decode step (through the rotating
    sliding-window caches, well past the window) gives transformers' logits."""
    model, processor = loaded(FAMILY, "hub")
    assert_decode_steps_match(tiny_checkpoints.model(FAMILY).model, model, processor,
                              CASES["image_in_second_turn"], reference(FAMILY, "image_in_second_turn"))


def test_chunked_prefill_keeps_images_whole(loaded, reference):
    """Chunks of 3 or 5 tokens would cut the 16-token images; the loop extends a chunk to
    the end of an image so that its tokens still see each other."""
    model, processor = loaded(FAMILY, "hub")
    assert tokens_of(model, processor, "two_images", prefill_step_size=3) == (
        reference(FAMILY, "two_images").tokens
    )
    assert tokens_of(model, processor, "image_in_second_turn", prefill_step_size=5) == (
        reference(FAMILY, "image_in_second_turn").tokens
    )


def test_a_chunk_that_splits_an_image_is_refused(loaded):
    model, processor = loaded(FAMILY, "hub")
    ids, embeddings, state = embedded(model, processor, *CASES["one_image"])
    (start, end), = state.spans
    assert end - start == 16
    with pytest.raises(ValueError, match="splits an image"):
        model(ids[:, : start + 3], model.make_cache(), embeddings=embeddings[:, : start + 3],
              state=state)


def test_image_blocks_and_their_spans():
    blocks = gemma3.ImageBlocks.from_input_ids(np.array([5, 9, 9, 9, 5, 9, 9, 5]), 9)
    assert blocks.ids.tolist() == [-1, 0, 0, 0, -1, 1, 1, -1]
    assert blocks.spans == [(1, 4), (5, 7)]
    assert blocks.prefix(4).ids.tolist() == [-1, 0, 0, 0]
    with pytest.raises(NotImplementedError):
        blocks.prefix(2)  # prompt-cache reuse cannot stop inside an image
    assert gemma3.ImageBlocks.batch([blocks, None]) is None  # decoding needs none


def test_batched_generation_gives_each_prompt_its_tokens(loaded, reference):
    """The batching engine decodes prompts of different lengths together through batched
    sliding-window caches; each still gets transformers' greedy tokens."""
    model, processor = loaded(FAMILY, "hub")
    assert_batched_tokens_match(model, processor, CASES, [reference(FAMILY, c) for c in CASES])


def test_rotating_cache_keeps_the_images(loaded, reference):
    """With --max-kv-size the global layers' caches rotate but keep the prompt's image
    tokens; until anything is evicted the tokens are the reference's."""
    model, processor = loaded(FAMILY, "transformers")
    assert_rotating_cache_keeps_the_prompt(model, processor, CASES["one_image"],
                                           reference(FAMILY, "one_image"))


def test_quantized_cache_runs_to_the_end(loaded, reference):
    """An 8-bit cache for the global layers (the sliding ones keep rotating)."""
    model, processor = loaded(FAMILY, "transformers")
    tokens = tokens_of(model, processor, "two_images", kv_bits=8, kv_group_size=32,
                       quantized_kv_start=0)
    assert len(tokens) == NEW_TOKENS
    assert tokens[:4] == reference(FAMILY, "two_images").tokens[:4]


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_bidirectional_image_attention_matters(loaded, reference):
    """Run the prompt causally (no image blocks in the state): far off the reference."""
    model, processor = loaded(FAMILY, "transformers")
    input_ids, embeddings, _ = embedded(model, processor, *CASES["one_image"])
    logits = first_pass(model, input_ids, embeddings, None)
    assert np.abs(logits - reference(FAMILY, "one_image").logits).max() > CAUGHT


@pytest.mark.parametrize("change", ["no_sliding_window", "default_local_theta", "no_rope_scaling"])
def test_config_errors_would_be_caught(change, tiny_checkpoints, loaded, reference):
    """A loader that ignored the window or read the wrong rope key would fail parity."""
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    text = config["text_config"]
    if change == "no_sliding_window":
        text["sliding_window"] = 4096
    elif change == "default_local_theta":
        del text["rope_local_base_freq"]
    else:
        del text["rope_scaling"]
    model, processor = loaded(FAMILY, "hub")
    assert_wrong_model_is_caught(gemma3.Model.from_config(config), model, processor,
                                 CASES["image_in_second_turn"], reference(FAMILY, "image_in_second_turn"))


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it into the same model."""
    ref = reference(FAMILY, "one_image")
    for layout in LAYOUTS:
        path = tiny_checkpoints.path(FAMILY, layout)
        logits = transformers_logits(load_transformers_model(path),
                                     gemma3.load_processor(path, {}), *CASES["one_image"])
        np.testing.assert_array_equal(logits, ref.logits)


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == new


def test_sanitized_names_are_mlx_community_names(tiny_checkpoints, loaded):
    """Every Hugging Face naming (transformers 5's saved names, the Hub's original ones,
    transformers 4.52+'s module tree) maps onto the names mlx-community's checkpoints use."""
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    reference_model = tiny_checkpoints.model(FAMILY).model
    namings = {
        "transformers 5": mx.load(str(tiny_checkpoints.path(FAMILY, "transformers") / "model.safetensors")),
        "hub": {k: mx.array(v) for k, v in hub_weights(reference_model).items()},
        "module tree": {k: mx.array(v.numpy()) for k, v in reference_model.state_dict().items()},
    }
    for naming, weights in namings.items():
        assert gemma3.is_hf_checkpoint(weights.keys()), naming
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected, naming
        assert not gemma3.is_hf_checkpoint(sanitized.keys()), naming
    for name in (
        "vision_tower.vision_model.embeddings.patch_embedding.weight",
        "vision_tower.vision_model.encoder.layers.1.self_attn.out_proj.weight",
        "vision_tower.vision_model.post_layernorm.weight",
        "multi_modal_projector.mm_input_projection_weight",
        "multi_modal_projector.mm_soft_emb_norm.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.5.self_attn.q_norm.weight",
        "language_model.model.layers.5.pre_feedforward_layernorm.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
    ):
        assert name in expected, name
    assert_patch_weight_is_channels_last(
        sanitized, "vision_tower.vision_model.embeddings.patch_embedding.weight", model.args.vision
    )


def test_an_mlx_layout_checkpoint_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    """A checkpoint saved in our names (as mlx-community's, head included) is not sanitized
    again and gives the same logits."""
    model, _ = loaded(FAMILY, "hub")
    mlx_model, processor = load(save_as_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path))
    _, logits = logits_of(mlx_model, processor, "two_images")
    np.testing.assert_allclose(logits, reference(FAMILY, "two_images").logits, rtol=0, atol=LOGITS_ATOL)
