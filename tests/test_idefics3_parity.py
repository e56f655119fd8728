"""Idefics3 and SmolVLM against transformers (float32), on tiny random checkpoints.

Both families are loaded from both config layouts (transformers 5's and the Hub's, see
tests/tiny/idefics3.py) through ``mlxvlm.load`` and compared with the in-memory
transformers model: logits of the first forward pass and greedy tokens through
``mlxvlm.stream_generate``, for text only, one image (2 x 2 tiles and the global view), two
images of different sizes (2 x 2 and 1 x 2 tiles) and an image in a later turn. The SigLIP
encoder's padded-image path, which real processor outputs rarely take, is compared with
transformers' encoder directly. Guards check that the tests can fail.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from parity import (
    LOGITS_ATOL,
    assert_another_image_changes_the_output,
    assert_batched_tokens_match,
    assert_decode_steps_match,
    assert_patch_weight_is_channels_last,
    assert_rotating_cache_keeps_the_prompt,
    assert_wrong_model_is_caught,
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
from tiny.idefics3 import FAMILIES, LAYOUTS, IMAGE_SEQ_LEN
from mlxvlm import load
from mlxvlm.models import get_family, idefics3
from mlxvlm.models.layers import siglip

torch = pytest.importorskip("torch")

IMAGE_A = make_image(112, 84, seed=1)  # 64 x 64 after resizing: 2 x 2 tiles + global
IMAGE_WIDE = make_image(112, 40, seed=2)  # 64 x 32: 1 x 2 tiles + global
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_WIDE, IMAGE_A2)
FAMILY_LAYOUTS = [(f, layout) for f in FAMILIES for layout in LAYOUTS]


def logits_of(model, processor, case):
    return our_logits(model, processor, *ALL_CASES[case])


def tokens_of(model, processor, case, **options):
    return our_tokens(model, processor, *ALL_CASES[case], **options)


# ----------------------------------------------------------------------------------- parity


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests(FAMILY_LAYOUTS, CASES)
)


def test_the_cases_cover_the_tile_layouts(loaded, reference):
    """One image is 2 x 2 tiles and the global view, the wide one 1 x 2 and the view."""
    _, processor = loaded("idefics3", "hub")
    ids = reference("idefics3", "two_images").input_ids
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_token) == (5 + 3) * IMAGE_SEQ_LEN
    for tile in ("<row_2_col_2>", "<row_1_col_2>", "<global-img>"):
        assert processor.tokenizer.convert_tokens_to_ids(tile) in ids


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_match_transformers(family, tiny_checkpoints, loaded, reference):
    """Teacher-forced on the reference's answer, every decode step gives its logits."""
    model, processor = loaded(family, "hub")
    assert_decode_steps_match(tiny_checkpoints.model(family).model, model, processor,
                              CASES["two_images"], reference(family, "two_images"))


def test_chunked_prefill_gives_the_same_tokens(loaded, reference):
    model, processor = loaded("idefics3", "hub")
    assert tokens_of(model, processor, "two_images", prefill_step_size=3) == (
        reference("idefics3", "two_images").tokens
    )


def test_batched_generation_gives_each_prompt_its_tokens(loaded, reference):
    model, processor = loaded("idefics3", "hub")
    assert_batched_tokens_match(model, processor, CASES, [reference("idefics3", c) for c in CASES])


def test_rotating_cache_keeps_the_images(loaded, reference):
    model, processor = loaded("smolvlm", "transformers")
    assert_rotating_cache_keeps_the_prompt(model, processor, CASES["one_image"],
                                           reference("smolvlm", "one_image"))


def test_padded_images_match_transformers_encoder():
    """Tiles smaller than the encoder's square are padded: padding patches are masked out
    of attention and real patches take fractional-grid positions. 7 patches per side makes
    the float32 bucket boundaries inexact, as on Idefics3-8B's 26."""
    from transformers import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    torch.manual_seed(0)
    config = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, image_size=56, patch_size=8,
                                  initializer_range=0.2)
    reference_encoder = Idefics3VisionTransformer(config).float().eval()
    pixels = torch.randn(3, 3, 56, 56)
    patch_mask = torch.zeros(3, 7, 7, dtype=torch.bool)
    patch_mask[0, :5, :3] = True
    patch_mask[1, :2, :7] = True
    patch_mask[2] = True
    with torch.no_grad():
        expected = reference_encoder(pixels, patch_attention_mask=patch_mask).last_hidden_state

    encoder = siglip.SiglipVisionTransformer(siglip.SiglipVisionConfig.from_hf(config.to_dict()))
    weights = {}
    for name, value in reference_encoder.state_dict().items():
        converted = siglip.convert_hf_weight(name, mx.array(value.numpy()))
        if converted is not None:
            weights[name] = converted
    encoder.load_weights(list(weights.items()))
    ours = encoder(mx.array(pixels.permute(0, 2, 3, 1).numpy()), patch_mask.numpy())
    np.testing.assert_allclose(np.array(ours), expected.numpy(), rtol=0, atol=LOGITS_ATOL)


# ---------------------------------------------------------------- the tests can fail


@pytest.mark.parametrize("family", FAMILIES)
def test_another_image_changes_the_output(family, loaded, reference):
    model, processor = loaded(family, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, family, reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_rope_theta_would_be_caught(family, tiny_checkpoints, loaded, reference):
    """The fixture's θ is not Llama's default, so reading the wrong key fails parity."""
    config = read_config(tiny_checkpoints, family, "hub")
    del config["text_config"]["rope_theta"]
    model, processor = loaded(family, "hub")
    assert_wrong_model_is_caught(idefics3.Model.from_config(config), model, processor,
                                 CASES["image_in_second_turn"], reference(family, "image_in_second_turn"))


# -------------------------------------------------------------- checkpoints and names


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_layout_reads_the_same_in_transformers(family, tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it into the same model."""
    ref = reference(family, "two_images")
    for layout in LAYOUTS:
        path = tiny_checkpoints.path(family, layout)
        processor = get_family(family).load_processor(path, {"model_type": family})
        logits = transformers_logits(load_transformers_model(path), processor, *CASES["two_images"])
        np.testing.assert_array_equal(logits, ref.logits)


def test_smolvlm_processor_builds_smolvlms_prompts(monkeypatch, tiny_checkpoints, loaded):
    """SmolVLM's own processor (made to build without its torchvision video processor and
    num2words, which only videos use) gives the same ids and pixels as the one mlxvlm
    builds for SmolVLM checkpoints."""
    from transformers import SmolVLMProcessor
    from transformers.models.smolvlm import processing_smolvlm

    from mlxvlm.models.processor_utils import image_only

    _, processor = loaded("smolvlm", "hub")
    monkeypatch.setattr(processing_smolvlm, "num2words", str)
    tiny = tiny_checkpoints.model("smolvlm")
    smolvlm = image_only(SmolVLMProcessor)(
        image_processor=tiny.image_processor, tokenizer=tiny.tokenizer, video_processor=None,
        image_seq_len=IMAGE_SEQ_LEN, chat_template=processor.chat_template,
    )
    messages, images = CASES["two_images"]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    ours = processor(text=[text], images=images, return_tensors="np")
    theirs = smolvlm(text=[text], images=images, return_tensors="np")
    np.testing.assert_array_equal(ours["input_ids"], theirs["input_ids"])
    np.testing.assert_array_equal(ours["pixel_values"], theirs["pixel_values"])
    np.testing.assert_array_equal(ours["pixel_attention_mask"], theirs["pixel_attention_mask"])


@pytest.mark.parametrize("family", FAMILIES)
def test_both_config_layouts_build_the_same_model(family, tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, family)
    assert hub == new


@pytest.mark.parametrize("family", FAMILIES)
def test_sanitized_names_are_mlx_community_names(family, tiny_checkpoints, loaded):
    model, _ = loaded(family, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    weights = mx.load(str(tiny_checkpoints.path(family, "hub") / "model.safetensors"))
    assert idefics3.is_hf_checkpoint(weights.keys())
    assert ("lm_head.weight" in weights) is (family == "idefics3")  # SmolVLM's is tied
    sanitized = model.sanitize(weights)
    assert set(sanitized) == expected
    assert not idefics3.is_hf_checkpoint(sanitized.keys())
    for name in (
        "vision_model.embeddings.patch_embedding.weight",
        "vision_model.embeddings.position_embedding.weight",
        "vision_model.encoder.layers.1.self_attn.out_proj.weight",
        "vision_model.post_layernorm.weight",
        "connector.modality_projection.proj.weight",
        "language_model.embed_tokens.weight",
        "language_model.layers.1.self_attn.q_proj.weight",
        "language_model.norm.weight",
        "language_model.lm_head.weight",
    ):
        assert name in expected, name
    assert_patch_weight_is_channels_last(
        sanitized, "vision_model.embeddings.patch_embedding.weight", model.args.vision
    )


def test_an_mlx_layout_checkpoint_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    model, _ = loaded("idefics3", "hub")
    mlx_model, processor = load(save_as_mlx_checkpoint(model, tiny_checkpoints.path("idefics3", "hub"), tmp_path))
    _, logits = logits_of(mlx_model, processor, "two_images")
    np.testing.assert_allclose(logits, reference("idefics3", "two_images").logits, rtol=0,
                               atol=LOGITS_ATOL)
