"""PaliGemma 2 against transformers (float32), on tiny random checkpoints.

PaliGemma is single-turn and always takes an image (its processor refuses text alone), so
the cases are one image, two images of different sizes, and a task prefix ("caption en");
there is no later turn to put an image in. Text alone is checked at the model level.
Both config layouts (transformers 5's and the Hub's sparse one, see tests/tiny/
paligemma.py) load through ``mlxvlm.load``; first-pass logits and 24 greedy tokens through
``mlxvlm.stream_generate`` must match. The answers run past the sliding window, and the
prefix-LM mask is checked to matter, to survive chunked prefill, and to give way to
causal attention after the prompt.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from parity import (
    LOGITS_ATOL,
    NEW_TOKENS,
    assert_another_image_changes_the_output,
    assert_batched_tokens_match,
    assert_patch_weight_is_channels_last,
    assert_wrong_model_is_caught,
    embedded,
    first_pass,
    load_transformers_model,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    our_decode_logits,
    our_tokens,
    parameter_list,
    processor_inputs,
    read_config,
    reference,  # noqa: F401 (fixture)
    standard_parity_tests,
    transformers_logits,
    user,
    with_other_image,
)
from tiny import make_image
from tiny.paligemma import LAYOUTS, SLIDING_WINDOW
from mlxvlm.models import get_family, paligemma

torch = pytest.importorskip("torch")

IMAGE_A = make_image(112, 84, seed=1)
IMAGE_B = make_image(84, 56, seed=2)
IMAGE_A2 = make_image(112, 84, seed=3)

CASES = {
    "one_image": (user(None, "Describe this image."), [IMAGE_A]),
    "two_images": (user(None, None, "Compare the two images."), [IMAGE_A, IMAGE_B]),
    "caption": (user(None, "caption en"), [IMAGE_B]),
}
ALL_CASES = with_other_image(CASES, IMAGE_A2)
FAMILY = "paligemma"


# ----------------------------------------------------------------------------------- parity


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests([(FAMILY, layout) for layout in LAYOUTS], CASES)
)


@pytest.mark.parametrize("case", CASES)
def test_every_answer_runs_past_the_sliding_window(case, reference):
    """Prompt and greedy answer span two windows, so the parity above exercises it."""
    assert len(reference(FAMILY, case).input_ids) + NEW_TOKENS > 2 * SLIDING_WINDOW


def test_chunked_prefill_keeps_the_prefix_whole(loaded, reference):
    """The loop chunks the prompt by prefill_step_size, but never inside a bidirectional
    span: PaliGemma's is the whole prompt, prefilled in one piece."""
    model, processor = loaded(FAMILY, "hub")
    messages, images = CASES["two_images"]
    ref = reference(FAMILY, "two_images")
    _, _, state = embedded(model, processor, messages, images)
    assert model.bidirectional_spans(state) == [(0, len(ref.input_ids))]
    assert our_tokens(model, processor, messages, images, prefill_step_size=3) == ref.tokens


def test_decode_steps_match_transformers_past_the_window(loaded, tiny_checkpoints, reference):
    """Teacher-forced on the reference's answer: transformers scores prompt (prefix,
    bidirectional) + answer (suffix, causal) in one pass; mlxvlm decodes token by token,
    the sliding-window layers dropping keys more than ``sliding_window`` back."""
    model, processor = loaded(FAMILY, "transformers")
    messages, images = CASES["caption"]
    ref = reference(FAMILY, "caption")
    continuation = ref.tokens[:-1]
    inputs = processor_inputs(processor, messages, images)
    inputs.pop("labels")  # the processor's training labels cover the prompt only
    extra = torch.tensor([continuation])
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.ones_like(extra)], dim=1)
    with torch.no_grad():
        expected = tiny_checkpoints.model(FAMILY).model(**inputs).logits[0].numpy()
    expected = expected[len(ref.input_ids) - 1:]
    ours = our_decode_logits(model, processor, messages, images, continuation)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=LOGITS_ATOL)

    # The window matters: with it switched off the later steps move away.
    unwindowed = get_family(FAMILY).Model(dataclasses.replace(model.args, sliding_window=None))
    unwindowed.load_weights(parameter_list(model))
    far = our_decode_logits(unwindowed, processor, messages, images, continuation)
    assert np.abs(far - expected).max() > 100 * LOGITS_ATOL


def test_text_only_matches_transformers(loaded, tiny_checkpoints):
    """The processor insists on images; the model itself runs a text-only prefix."""
    model, processor = loaded(FAMILY, "hub")
    tokenizer = processor.tokenizer
    ids = [tokenizer.bos_token_id] + tokenizer.encode("Tell me a story.", add_special_tokens=False)
    ids += tokenizer.encode("\n", add_special_tokens=False)
    with torch.no_grad():
        expected = tiny_checkpoints.model(FAMILY).model(
            input_ids=torch.tensor([ids]), token_type_ids=torch.zeros(1, len(ids), dtype=torch.long)
        ).logits[0].numpy()
    input_ids = mx.array([ids])
    embeddings, state = model.embed(input_ids)
    logits = model(input_ids, model.make_cache(), embeddings=embeddings, state=state)
    np.testing.assert_allclose(np.array(logits[0]), expected, rtol=0, atol=LOGITS_ATOL)


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_prefix_lm_mask_matters(loaded, reference):
    """A causal mask over the prompt (no bidirectional prefix) moves the logits far."""
    model, processor = loaded(FAMILY, "transformers")
    input_ids, embeddings, _ = embedded(model, processor, *CASES["one_image"])
    causal = first_pass(model, input_ids, embeddings, paligemma.Prefix(0))
    assert np.abs(causal - reference(FAMILY, "one_image").logits).max() > 0.1


def test_wrong_rope_theta_would_be_caught(tiny_checkpoints, loaded, reference):
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    del config["text_config"]["rope_theta"]
    model, processor = loaded(FAMILY, "hub")
    assert_wrong_model_is_caught(get_family(FAMILY).Model.from_config(config), model, processor,
                                 CASES["caption"], reference(FAMILY, "caption"))


def test_single_turn_template_refuses_a_conversation(loaded):
    model, processor = loaded(FAMILY, "hub")
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(Exception, match="exactly one user turn"):
        our_tokens(model, processor, history + CASES["caption"][0], [IMAGE_B])


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    path = tiny_checkpoints.path(FAMILY, "hub")
    logits = transformers_logits(load_transformers_model(path), paligemma.load_processor(path, {}),
                                 *CASES["two_images"])
    np.testing.assert_array_equal(logits, reference(FAMILY, "two_images").logits)


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == new
    assert new.sliding_layers == (True, False) and new.sliding_window == SLIDING_WINDOW
    assert new.text.rope_theta == 5000.0 and new.text.query_pre_attn_scalar == 48


def test_sanitized_names_are_mlx_community_names(tiny_checkpoints, loaded):
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        weights = mx.load(str(tiny_checkpoints.path(FAMILY, layout) / "model.safetensors"))
        assert paligemma.is_hf_checkpoint(weights.keys())
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected
    assert_patch_weight_is_channels_last(
        sanitized, "vision_tower.vision_model.embeddings.patch_embedding.weight", model.args.vision
    )
    for name in (
        "vision_tower.vision_model.embeddings.position_embedding.weight",
        "vision_tower.vision_model.encoder.layers.1.self_attn.out_proj.weight",
        "vision_tower.vision_model.post_layernorm.weight",
        "multi_modal_projector.linear.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.1.pre_feedforward_layernorm.weight",
        "language_model.model.layers.1.post_feedforward_layernorm.weight",
        "language_model.model.norm.weight",
    ):
        assert name in expected, name
    assert not any(name.startswith("language_model.lm_head") for name in expected)  # tied


def test_batched_generation_gives_each_prompt_its_tokens(loaded, reference):
    """The batching engine decodes the prompts together (per-row offsets, Gemma 2's
    grouped-head scores); each still gets transformers' greedy tokens."""
    model, processor = loaded(FAMILY, "hub")
    assert_batched_tokens_match(model, processor, CASES, [reference(FAMILY, c) for c in CASES])
