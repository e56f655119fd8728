"""Qwen3.5 and Qwen3.5-MoE (hybrid Gated DeltaNet / gated attention decoder) against
transformers (float32), on tiny random checkpoints (tests/tiny/qwen3_5.py).

Both config layouts load through ``mlxvlm.load`` and are compared with the in-memory
transformers model: first-pass logits and 24 greedy tokens through
``mlxvlm.stream_generate`` for text, one image, two images and an image in a later turn;
a prefill cut into chunks of 3 tokens (each linear layer's convolution window and
recurrent state carried across chunks); every decode step teacher-forced on the
reference's answer; the chat template's thinking switch on and off. Guards: another
image changes the output, the linear layers' state matters, a wrong rope θ is caught.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from parity import (
    assert_another_image_changes_the_output,
    assert_decode_steps_match,
    assert_reference_is_decisive,
    assert_wrong_model_is_caught,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    our_logits,
    our_tokens,
    parameter_list,
    read_config,
    reference,  # noqa: F401 (fixture)
    reference_run,
    standard_cases,
    standard_parity_tests,
    transformers_logits,
    load_transformers_model,
    CAUGHT,
)
from tiny import make_image
from tiny.qwen3_5 import FAMILIES, LAYOUTS
from mlxvlm.models import get_family
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

IMAGE_A = make_image(112, 84, seed=1)  # 6 x 8 patches of 16 px -> 12 tokens
IMAGE_B = make_image(84, 56, seed=2)  # 4 x 6 patches -> 6 tokens
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_B, IMAGE_A2)
FAMILY = "qwen3_5"
FAMILY_LAYOUTS = [(family, layout) for family in FAMILIES for layout in LAYOUTS]
THINKING_OFF = {"enable_thinking": False}


def tokens(model, processor, case: str, **options) -> list[int]:
    return our_tokens(model, processor, *ALL_CASES[case], **options)


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests(FAMILY_LAYOUTS, CASES)
)


def test_chunked_prefill_carries_the_linear_state(loaded, reference):
    """Chunks of 3 tokens cut through text and image runs: every linear layer must carry
    its convolution window and recurrent state from chunk to chunk."""
    model, processor = loaded(FAMILY, "hub")
    assert tokens(model, processor, "two_images", prefill_step_size=3) == (
        reference(FAMILY, "two_images").tokens
    )


def test_decode_steps_match_transformers(tiny_checkpoints, loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_decode_steps_match(tiny_checkpoints.model(FAMILY).model, model, processor,
                              CASES["image_in_second_turn"],
                              reference(FAMILY, "image_in_second_turn"))


@pytest.fixture(scope="module")
def thinking_off_reference(tiny_checkpoints, loaded):
    _, processor = loaded(FAMILY, "transformers")
    return reference_run(tiny_checkpoints.model(FAMILY).model, processor,
                         *CASES["one_image"], **THINKING_OFF)


def test_thinking_off_matches_transformers(loaded, reference, thinking_off_reference):
    """``enable_thinking=False`` (the template closes an empty thinking block) gives
    another prompt than the default (a thinking block left open), each matching
    transformers' own."""
    model, processor = loaded(FAMILY, "transformers")
    thinking_on = reference(FAMILY, "one_image")
    assert thinking_off_reference.input_ids != thinking_on.input_ids
    inputs = prepare_inputs(processor, *CASES["one_image"], chat_template_kwargs=THINKING_OFF)
    assert inputs.input_ids[0].tolist() == thinking_off_reference.input_ids
    assert_reference_is_decisive(thinking_off_reference)
    assert tokens(model, processor, "one_image",
                  chat_template_kwargs=THINKING_OFF) == thinking_off_reference.tokens
    assert thinking_off_reference.tokens != thinking_on.tokens


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_linear_state_matters(loaded, reference):
    """Linear layers that forget their convolution window and recurrent state before a
    decode step moves the logits far from the reference: the decode parity
    exercises the state."""
    model, processor = loaded(FAMILY, "transformers")
    ref = reference(FAMILY, "text")
    messages, images = CASES["text"]
    inputs = prepare_inputs(processor, messages, images, feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    cache = model.make_cache()
    model(inputs.input_ids, cache, embeddings=embeddings, state=state)
    for layer_cache in cache:
        if not hasattr(layer_cache, "offset"):  # a linear layer: convolution window, state
            layer_cache[0] = mx.zeros_like(layer_cache[0])
            layer_cache[1] = mx.zeros_like(layer_cache[1])
    logits = model(mx.array([[ref.tokens[0]]]), cache, state=state)[0, -1]
    ids = ref.input_ids + [ref.tokens[0]]
    fresh = model.make_cache()
    whole = model(mx.array([ids]), fresh)[0, -1]
    assert np.abs(np.array(logits) - np.array(whole)).max() > CAUGHT


def test_wrong_rope_theta_would_be_caught(tiny_checkpoints, loaded, reference):
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    del config["text_config"]["rope_parameters"]["rope_theta"]
    model, processor = loaded(FAMILY, "hub")
    assert_wrong_model_is_caught(get_family(FAMILY).Model.from_config(config), model, processor,
                                 CASES["image_in_second_turn"],
                                 reference(FAMILY, "image_in_second_turn"))


# -------------------------------------------------------------- checkpoints and names


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_layout_reads_the_same_in_transformers(family, tiny_checkpoints, reference):
    path = tiny_checkpoints.path(family, "hub")
    processor = get_family(family).load_processor(path, {})
    logits = transformers_logits(load_transformers_model(path), processor, *CASES["one_image"])
    np.testing.assert_array_equal(logits, reference(family, "one_image").logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_both_config_layouts_build_the_same_model(family, tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, family)
    # The Hub's config names its multi-token-prediction head; transformers' drops it.
    assert hub.text.mtp_num_hidden_layers == 1 and new.text.mtp_num_hidden_layers == 0
    assert replace(hub, text=replace(hub.text, mtp_num_hidden_layers=0)) == new
    assert new.text.layer_types == ("linear_attention", "full_attention") * 2
    assert new.text.rotary_dim == 16 and new.text.rope_theta == 5000.0
    assert new.vision.deepstack_visual_indexes == ()


@pytest.mark.parametrize("family", FAMILIES)
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
        # The Hub's also holds the multi-token-prediction head, under language_model.mtp.
        head = {name for name in sanitized if name.startswith("language_model.mtp.")}
        assert bool(head) == (layout == "hub")
        assert "language_model.mtp.fc.weight" in head or not head
        assert set(sanitized) == expected | head
        assert set(sanitized) == {name for name, _ in parameter_list(layout_model)}
        assert not module.is_hf_checkpoint(sanitized.keys())
    for name in [
        "vision_tower.pos_embed.weight",
        "vision_tower.merger.linear_fc2.weight",
        "language_model.model.layers.0.linear_attn.in_proj_qkv.weight",
        "language_model.model.layers.0.linear_attn.conv1d.weight",
        "language_model.model.layers.0.linear_attn.A_log",
        "language_model.model.layers.0.linear_attn.norm.weight",
        "language_model.model.layers.1.self_attn.q_norm.weight",
        "language_model.model.layers.1.self_attn.q_proj.weight",
        "language_model.model.norm.weight",
    ]:
        assert name in expected, name
    if family == "qwen3_5_moe":
        for name in ["language_model.lm_head.weight",
                     "language_model.model.layers.0.mlp.gate.weight",
                     "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight",
                     "language_model.model.layers.1.mlp.switch_mlp.down_proj.weight",
                     "language_model.model.layers.1.mlp.shared_expert.up_proj.weight",
                     "language_model.model.layers.1.mlp.shared_expert_gate.weight"]:
            assert name in expected, name
    else:
        assert "language_model.lm_head.weight" not in expected  # tied


def test_moe_experts_read_in_either_orientation(tiny_checkpoints, loaded):
    """Expert tensors stored (experts, in, out) give the same model as transformers 5's
    (experts, out, in): the orientation is read from their shape."""
    module = get_family("qwen3_5_moe")
    model, _ = loaded("qwen3_5_moe", "transformers")
    weights = mx.load(str(tiny_checkpoints.path("qwen3_5_moe", "transformers") / "model.safetensors"))
    config = read_config(tiny_checkpoints, "qwen3_5_moe", "transformers")
    flipped = {k: v.transpose(0, 2, 1) if ".mlp.experts." in k else v for k, v in weights.items()}
    sanitized = module.Model.from_config(config).sanitize(flipped)
    for name, value in parameter_list(model):
        np.testing.assert_array_equal(np.array(sanitized[name]), np.array(value), err_msg=name)


# ------------------------------------------------------------------------------- video


@pytest.mark.parametrize("family", FAMILIES)
def test_video_frames_with_timestamps_match_transformers(family, tiny_checkpoints, loaded):
    """A 2-frame video prompted as Qwen3.5 prompts videos (each frame's tokens after a
    "<t seconds>" timestamp, each frame its own M-RoPE grid) after an image, the same
    patches fed to both sides: first-pass logits and 24 greedy tokens (prefilled in
    chunks of 5, through the linear layers' state) as transformers'. (Frame sampling and
    the video processor are Qwen3-VL's, tested in tests/test_qwen_video_parity.py.)"""
    reference_model = tiny_checkpoints.model(family).model
    model, processor = loaded(family, "transformers")
    tok = processor.tokenizer
    start, end = (tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    image_pad, video_pad = (tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))
    ids = tok.encode("<|im_start|>user\nLook:") + [start] + [image_pad] * 4 + [end]
    ids += tok.encode("Now the clip:")
    for seconds in ("<0.5 seconds>", "<1.5 seconds>"):
        ids += tok.encode(seconds) + [start] + [video_pad] * 6 + [end]
    ids += tok.encode("What happens?<|im_end|>\n<|im_start|>assistant\n")
    rng = np.random.default_rng(0)
    patch = 3 * 2 * 16 * 16
    features = {
        "pixel_values": rng.normal(size=(16, patch)).astype(np.float32),
        "image_grid_thw": np.array([[1, 4, 4]]),
        "pixel_values_videos": rng.normal(size=(48, patch)).astype(np.float32),
        "video_grid_thw": np.array([[2, 4, 6]]),
    }
    token_types = [1 if t == image_pad else 2 if t == video_pad else 0 for t in ids]
    torch_inputs = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                        mm_token_type_ids=torch.tensor([token_types]),
                        **{k: torch.from_numpy(v) for k, v in features.items()})
    with torch.no_grad():
        ref_logits = reference_model(**torch_inputs).logits[0].numpy()
        out = reference_model.generate(**torch_inputs, max_new_tokens=24, do_sample=False,
                                       output_scores=True, return_dict_in_generate=True)
    ref_tokens = out.sequences[0, len(ids):].tolist()
    margin = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores)

    input_ids = mx.array([ids], dtype=mx.int32)
    embeddings, state = model.embed(input_ids, **{k: mx.array(v) for k, v in features.items()})
    logits = model(input_ids, model.make_cache(), embeddings=embeddings, state=state)
    np.testing.assert_allclose(np.array(logits[0]), ref_logits, rtol=0, atol=1e-4)

    assert len(ref_tokens) == 24 and margin > 1e-3
    cache, tokens = model.make_cache(), []
    for first in range(0, len(ids), 5):
        chunk = slice(first, min(first + 5, len(ids)))
        logits = model(input_ids[:, chunk], cache, embeddings=embeddings[:, chunk], state=state)
    for _ in range(24):
        tokens.append(int(logits[0, -1].argmax()))
        logits = model(mx.array([[tokens[-1]]]), cache, state=state)
    assert tokens == ref_tokens
