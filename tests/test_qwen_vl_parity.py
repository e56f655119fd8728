"""Qwen2-VL and Qwen2.5-VL against transformers (float32), on tiny random checkpoints.

Every family is loaded from both config layouts (transformers 5's and the Hub's older
one, see tests/tiny/) through ``mlxvlm.load`` and compared with the in-memory transformers
model the checkpoint was saved from: logits of the first forward pass, and greedy tokens
through ``mlxvlm.stream_generate`` — for text only, one image, two images of different
sizes, and an image in a later user turn. Guards check that the tests can fail: another
image changes the output, the wrong rope θ changes the logits, and the reference's greedy
steps are not decided by razor-thin logit margins.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache

import parity
from parity import (
    LOGITS_ATOL,
    MIN_REFERENCE_MARGIN,
    NEW_TOKENS,
    loaded,  # noqa: F401 (fixture)
    parameter_list,
    reference,  # noqa: F401 (fixture)
)
from tiny import make_image
from tiny.qwen import FAMILIES, LAYOUTS
from mlxvlm.models import get_family
from mlxvlm.models.layers.mrope_decoder import MRopeState
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

IMAGE_A = make_image(112, 84, seed=1)  # 6 x 8 patches -> 12 tokens
IMAGE_B = make_image(84, 56, seed=2)  # 4 x 6 patches -> 6 tokens
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content

CASES = {
    "text": ([{"role": "user", "content": "Tell me a story about a red cat."}], []),
    "one_image": (
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}],
        [IMAGE_A],
    ),
    "two_images": (
        [{"role": "user", "content": [
            {"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare the two images."},
        ]}],
        [IMAGE_A, IMAGE_B],
    ),
    "image_in_second_turn": (
        [
            {"role": "user", "content": "Hello! Who are you?"},
            {"role": "assistant", "content": "I am a helpful assistant."},
            {"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": "What is in this picture?"},
            ]},
        ],
        [IMAGE_B],
    ),
}
# Not a parity case of its own: the guard that the image matters.
ALL_CASES = {**CASES, "one_other_image": (CASES["one_image"][0], [IMAGE_A2])}
FAMILY_LAYOUTS = [(f, layout) for f in FAMILIES for layout in LAYOUTS]


# --------------------------------------------------------------------------------- helpers


def our_logits(model, processor, case: str) -> tuple[list[int], np.ndarray]:
    return parity.our_logits(model, processor, *ALL_CASES[case])


def our_tokens(model, processor, case: str, **options) -> list[int]:
    return parity.our_tokens(model, processor, *ALL_CASES[case], **options)


# ----------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family,layout", FAMILY_LAYOUTS)
def test_first_pass_logits_match_transformers(family, layout, case, loaded, reference):
    model, processor = loaded(family, layout)
    ref_ids, ref_logits, _, _ = reference(family, case)
    ids, logits = our_logits(model, processor, case)
    assert ids == ref_ids, "the processor built by mlxvlm tokenized the prompt differently"
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family,layout", FAMILY_LAYOUTS)
def test_greedy_tokens_match_transformers(family, layout, case, loaded, reference):
    model, processor = loaded(family, layout)
    _, _, ref_tokens, margin = reference(family, case)
    assert len(ref_tokens) == NEW_TOKENS, "the reference stopped early; pick another prompt"
    assert margin > MIN_REFERENCE_MARGIN, f"top-1/top-2 margin {margin:.2e} is too thin"
    assert our_tokens(model, processor, case) == ref_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_gives_the_same_tokens(family, loaded, reference):
    """Chunks of 3 tokens split the images' placeholder runs and the M-RoPE ids."""
    model, processor = loaded(family, "hub")
    _, _, ref_tokens, _ = reference(family, "two_images")
    assert our_tokens(model, processor, "two_images", prefill_step_size=3) == ref_tokens
    assert our_tokens(model, processor, "image_in_second_turn", prefill_step_size=5) == (
        reference(family, "image_in_second_turn")[2]
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_rotating_cache_keeps_positions(family, loaded, reference):
    """A rotating cache (offset counts every token) gives the reference's tokens as long as
    nothing was evicted, and keeps generating once it rotates."""
    model, processor = loaded(family, "transformers")
    ref_ids, _, ref_tokens, _ = reference(family, "one_image")
    max_kv_size = len(ref_ids) + NEW_TOKENS // 2
    tokens = our_tokens(model, processor, "one_image", max_kv_size=max_kv_size)
    assert len(tokens) == NEW_TOKENS
    assert tokens[: NEW_TOKENS // 2] == ref_tokens[: NEW_TOKENS // 2]


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_cache_tracks_the_full_precision_cache(family, loaded, reference):
    """Teacher-forced on the reference's answer, an 8-bit KV cache stays within rounding
    noise of the float cache (wrong positions would be off by ~7 on these models)."""
    model, processor = loaded(family, "transformers")
    messages, images = CASES["image_in_second_turn"]
    _, _, ref_tokens, _ = reference(family, "image_in_second_turn")
    inputs = prepare_inputs(processor, messages, images, feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)

    def teacher_forced(cache) -> np.ndarray:
        steps = [model(inputs.input_ids, cache, embeddings=embeddings, state=state)[0, -1]]
        for token in ref_tokens[:-1]:
            steps.append(model(mx.array([[token]]), cache, state=state)[0, -1])
        return np.array(mx.stack(steps))

    exact = teacher_forced(model.make_cache())
    assert exact.argmax(-1).tolist() == ref_tokens
    quantized = teacher_forced([QuantizedKVCache(group_size=32, bits=8) for _ in model.layers])
    assert np.abs(quantized - exact).max() < 1.0
    assert (quantized.argmax(-1) == exact.argmax(-1)).mean() > 0.75
    # and the generate loop's own switch to a quantized cache runs to the end
    tokens = our_tokens(
        model, processor, "one_image", kv_bits=8, kv_group_size=32, quantized_kv_start=0
    )
    assert len(tokens) == NEW_TOKENS


# ---------------------------------------------------------------- the tests can fail


@pytest.mark.parametrize("family", FAMILIES)
def test_another_image_changes_the_output(family, loaded, reference):
    model, processor = loaded(family, "transformers")
    tokens = our_tokens(model, processor, "one_image")
    other_tokens = our_tokens(model, processor, "one_other_image")
    assert tokens != other_tokens
    assert other_tokens == reference(family, "one_other_image")[2]


@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_rope_theta_would_be_caught(family, tiny_checkpoints, loaded, reference):
    """The fixture's θ is not the default, so a loader reading the wrong key fails parity."""
    config = json.loads((tiny_checkpoints.path(family, "hub") / "config.json").read_text())
    del config["rope_theta"]  # what a loader looking only at rope_parameters would see
    model, processor = loaded(family, "hub")
    wrong = get_family(family).Model.from_config(config)
    wrong.load_weights(parameter_list(model))
    _, ref_logits, _, _ = reference(family, "image_in_second_turn")
    _, logits = our_logits(wrong, processor, "image_in_second_turn")
    assert np.abs(logits - ref_logits).max() > 100 * LOGITS_ATOL


# -------------------------------------------------------------- checkpoints and names


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_layout_reads_the_same_in_transformers(family, tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it into the same model."""
    from transformers import AutoModelForImageTextToText

    messages, images = CASES["one_image"]
    _, ref_logits, _, _ = reference(family, "one_image")
    for layout in LAYOUTS:
        path = tiny_checkpoints.path(family, layout)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        assert model.config.text_config.rope_parameters["rope_theta"] != 1_000_000.0
        processor = get_family(family).load_processor(path, {})
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=[text], images=images, return_tensors="pt")
        with torch.no_grad():
            logits = model(**inputs).logits[0].numpy()
        np.testing.assert_array_equal(logits, ref_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_both_config_layouts_build_the_same_model(family, tiny_checkpoints):
    read = lambda layout: json.loads(  # noqa: E731
        (tiny_checkpoints.path(family, layout) / "config.json").read_text()
    )
    Model = get_family(family).Model
    assert Model.from_config(read("hub")).args == Model.from_config(read("transformers")).args


@pytest.mark.parametrize("family", FAMILIES)
def test_sanitized_names_are_mlx_community_names(family, tiny_checkpoints, loaded):
    """Every Hugging Face naming maps onto the names mlx-community's checkpoints use."""
    module = get_family(family)
    model, _ = loaded(family, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    namings = [mx.load(str(tiny_checkpoints.path(family, layout) / "model.safetensors"))
               for layout in LAYOUTS]
    for weights in namings:
        assert module.is_hf_checkpoint(weights.keys())
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected
        assert not module.is_hf_checkpoint(sanitized.keys())

    tied = model.args.text.tie_word_embeddings
    assert ("language_model.lm_head.weight" in expected) is (not tied)
    for name in (
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.1.self_attn.q_proj.bias",
        "language_model.model.norm.weight",
        "vision_tower.blocks.1.attn.qkv.weight",
        "vision_tower.merger.ln_q.weight",
        "vision_tower.merger.mlp.0.weight",
        "vision_tower.merger.mlp.2.weight",
    ):
        assert name in expected, name
    v = model.args.vision
    assert sanitized["vision_tower.patch_embed.proj.weight"].shape == (
        v.hidden_size, v.temporal_patch_size, v.patch_size, v.patch_size, v.in_channels
    )


def test_mrope_positions_continue_after_the_prompt():
    prompt_ids = mx.array([[0, 1, 2, 2, 2, 3], [0, 1, 2, 3, 2, 3], [0, 1, 2, 3, 4, 5]])
    state = MRopeState(prompt_ids, rope_delta=-1)
    whole = np.array(state.positions(0, 9))
    assert np.array_equal(whole[:, :6], np.array(prompt_ids))
    assert np.array_equal(whole[:, 6:], np.broadcast_to([5, 6, 7], (3, 3)))
    chunks = np.concatenate([np.array(state.positions(o, 2)) for o in range(0, 9, 2)], axis=1)
    assert np.array_equal(chunks[:, :9], whole)


@pytest.mark.parametrize("family", FAMILIES)
def test_video_grid_features_and_positions_match_transformers(family, tiny_checkpoints, loaded):
    """Video input proper (frame sampling, the video processor) is not wired yet, but the
    model already takes video patches: feed the same synthetic ones to both sides, with an
    image too, so that M-RoPE runs over mixed image and video grids."""
    reference_model = tiny_checkpoints.model(family).model
    model, processor = loaded(family, "transformers")
    token = processor.tokenizer.convert_tokens_to_ids
    text = processor.tokenizer.encode("Watch this:")
    image_grid, video_grid = [1, 4, 4], [3, 4, 6]  # 4 image tokens, 18 video tokens
    ids = (
        text + [token("<|vision_start|>")] + [token("<|image_pad|>")] * 4
        + [token("<|vision_end|>")] + text + [token("<|vision_start|>")]
        + [token("<|video_pad|>")] * 18 + [token("<|vision_end|>")] + text
    )
    rng = np.random.default_rng(0)
    patch = 3 * 2 * 14 * 14
    features = {
        "pixel_values": rng.normal(size=(16, patch)).astype(np.float32),
        "image_grid_thw": np.array([image_grid]),
        "pixel_values_videos": rng.normal(size=(72, patch)).astype(np.float32),
        "video_grid_thw": np.array([video_grid]),
    }
    if family == "qwen2_5_vl":
        features["second_per_grid_ts"] = np.array([0.75], dtype=np.float32)  # 1.5 ids / grid
    token_types = [1 if t == token("<|image_pad|>") else 2 if t == token("<|video_pad|>") else 0
                   for t in ids]
    with torch.no_grad():
        ref_logits = reference_model(
            input_ids=torch.tensor([ids]),
            mm_token_type_ids=torch.tensor([token_types]),
            **{k: torch.from_numpy(v) for k, v in features.items()},
        ).logits[0].numpy()
    input_ids = mx.array([ids], dtype=mx.int32)
    embeddings, state = model.embed(input_ids, **{k: mx.array(v) for k, v in features.items()})
    logits = model(input_ids, model.make_cache(), embeddings=embeddings, state=state)
    np.testing.assert_allclose(np.array(logits[0]), ref_logits, rtol=0, atol=LOGITS_ATOL)
