"""LFM2-VL against transformers (float32), on a tiny random checkpoint.

Loaded from both config layouts (transformers 5's and LiquidAI's, see tests/tiny/lfm2_vl.py)
through ``mlxvlm.load`` and compared with the in-memory transformers model: logits of the
first forward pass and greedy tokens through ``mlxvlm.stream_generate``, for text only,
one image (2 x 2 tiles and a thumbnail), two images (that one and a wide one: 1 x 3 tiles
and a thumbnail), an image in a later turn, and two small images of other aspect ratios
resized as one (NaFlex: a square one upscaled, a tall 6 x 1 one). The convolution state
carries across prefill chunks and decode steps; the NaFlex tower is compared with
transformers' directly on a padded batch; guards check that the tests can fail.
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
    assert_first_pass_matches,
    assert_greedy_tokens_match,
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
    transformers_logits,
    user,
)
from tiny import make_image
from tiny.lfm2_vl import LAYOUTS
from mlxvlm import load
from mlxvlm.models import get_family, lfm2_vl
from mlxvlm.models.feature_cache import no_feature_cache
from mlxvlm.models.layers import siglip2

torch = pytest.importorskip("torch")

FAMILY = "lfm2_vl"
IMAGE_A = make_image(112, 84, seed=1)  # 2 x 2 tiles of 64 + a 48 x 64 thumbnail
IMAGE_WIDE = make_image(300, 120, seed=2)  # 1 x 3 tiles + a 32 x 96 thumbnail
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content
IMAGE_SMALL = make_image(30, 30, seed=4)  # one view, upscaled to 32 x 32
IMAGE_TALL = make_image(17, 90, seed=5)  # one view, 96 x 16: 12 x 2 patches

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_WIDE, IMAGE_A2)
CASES["small_images"] = (user(None, "Describe this image.", None), [IMAGE_SMALL, IMAGE_TALL])
ALL_CASES["small_images"] = CASES["small_images"]


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


def test_the_cases_cover_tiles_thumbnails_and_single_views(loaded, reference):
    """The two-image prompt has A's 2 x 2 tiles and the wide one's 1 x 3, each with a
    thumbnail; the small ones are a view each, of 4 and 6 tokens."""
    _, processor = loaded(FAMILY, "hub")
    tokens = processor.tokenizer.convert_tokens_to_ids
    ids = reference(FAMILY, "two_images").input_ids
    assert ids.count(tokens("<|img_thumbnail|>")) == 2
    assert ids.count(tokens("<|img_row_2_col_2|>")) == 1 and ids.count(tokens("<|img_row_1_col_3|>")) == 1
    assert ids.count(tokens("<image>")) == 4 * 16 + 12 + 3 * 16 + 12
    small = reference(FAMILY, "small_images").input_ids
    assert small.count(tokens("<image>")) == 4 + 6
    assert tokens("<|img_thumbnail|>") not in small


def test_one_bos_as_lfm2s_tokenizer_gives(loaded, reference):
    """LFM2's tokenizer prepends <|startoftext|> and its template writes it: the prompt
    starts with it once, as transformers tokenizes it."""
    _, processor = loaded(FAMILY, "transformers")
    bos = processor.tokenizer.convert_tokens_to_ids("<|startoftext|>")
    assert processor.tokenizer("hi")["input_ids"][0] == bos  # the fixture is what it says
    ids = reference(FAMILY, "text").input_ids
    assert ids[0] == bos and ids.count(bos) == 1


def test_decode_steps_match_transformers(tiny_checkpoints, loaded, reference):
    """Teacher-forced on the reference's answer, every decode step (one token through the
    convolution state and the KV cache) gives its logits."""
    model, processor = loaded(FAMILY, "hub")
    assert_decode_steps_match(tiny_checkpoints.model(FAMILY).model, model, processor,
                              CASES["two_images"], reference(FAMILY, "two_images"))


@pytest.mark.parametrize("step", [3, 50])
def test_chunked_prefill_gives_the_same_tokens(step, loaded, reference):
    """A prompt prefilled in chunks (of 3: shorter than the kernel's history plus one; of
    50: several chunks through the images) carries the convolution state across them."""
    model, processor = loaded(FAMILY, "hub")
    assert our_tokens(model, processor, *CASES["two_images"], prefill_step_size=step) == (
        reference(FAMILY, "two_images").tokens
    )


def test_batched_generation_gives_each_prompt_its_tokens(loaded, reference):
    """Decoded together (each request's convolution state one row of the batch's, its KV
    cache one row of mlx-lm's batched cache), every prompt keeps its reference's tokens."""
    model, processor = loaded(FAMILY, "transformers")
    assert_batched_tokens_match(model, processor, CASES, [reference(FAMILY, c) for c in CASES])


def test_the_server_answers_with_the_reference_tokens(loaded, reference):
    """Two chat requests at once over HTTP (an image one and a text one, batched by the
    server's engine) answer with their references' greedy text."""
    from concurrent.futures import ThreadPoolExecutor

    from server_harness import LiveServer, png_data_url
    from server_harness import user as server_user

    model, processor = loaded(FAMILY, "hub")
    requests = {
        "one_image": [server_user("Describe this image.", png_data_url(IMAGE_A))],
        "text": [{"role": "user", "content": CASES["text"][0][0]["content"]}],
    }
    with LiveServer(model, processor) as server:
        client = server.client()

        def ask(messages):
            return client.chat.completions.create(model=server.config.model_id, messages=messages,
                                                  max_tokens=24, temperature=0.0)

        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(requests, pool.map(ask, requests.values())))
    for case, answer in answers.items():
        expected = processor.tokenizer.decode(reference(FAMILY, case).tokens, skip_special_tokens=True)
        assert answer.choices[0].message.content == expected
        assert answer.usage.prompt_tokens == len(reference(FAMILY, case).input_ids)


def test_naflex_tower_matches_transformers_on_a_padded_batch():
    """transformers' tower on a padded batch of three grids (down- and upscaled position
    grids, one at full length), masked; ours runs each image on its own real patches."""
    from transformers import Siglip2VisionConfig
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionModel

    torch.manual_seed(0)
    config = Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, patch_size=4, num_patches=49,
                                 vision_use_head=False, initializer_range=0.2)
    tower = Siglip2VisionModel(config).float().eval()
    shapes = [(3, 5), (12, 2), (5, 8)]
    length = 40
    pixels = torch.randn(len(shapes), length, 3 * 4 * 4)
    mask = torch.zeros(len(shapes), length, dtype=torch.long)
    for i, (r, c) in enumerate(shapes):
        mask[i, : r * c] = 1
    with torch.no_grad():
        expected = tower(pixel_values=pixels, pixel_attention_mask=mask,
                         spatial_shapes=torch.tensor(shapes)).last_hidden_state.numpy()

    ours = siglip2.Siglip2VisionModel(siglip2.Siglip2VisionConfig.from_hf(config.to_dict()))
    weights = [(k, mx.array(v.numpy())) for k, v in tower.state_dict().items()]
    ours.load_weights([(k, siglip2.convert_hf_weight(k, v)) for k, v in weights
                       if siglip2.convert_hf_weight(k, v) is not None])
    for i, (r, c) in enumerate(shapes):
        out = ours(mx.array(pixels[i : i + 1, : r * c].numpy()), r, c)
        np.testing.assert_allclose(np.array(out[0]), expected[i, : r * c], rtol=0, atol=LOGITS_ATOL)


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_wrong_rope_theta_would_be_caught(tiny_checkpoints, loaded, reference):
    """The fixture's θ is not LFM2's default, so reading the wrong key fails parity."""
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    del config["text_config"]["rope_theta"]
    model, processor = loaded(FAMILY, "hub")
    assert_wrong_model_is_caught(lfm2_vl.Model.from_config(config), model, processor,
                                 CASES["image_in_second_turn"], reference(FAMILY, "image_in_second_turn"))


def test_wrong_unshuffle_order_would_be_caught(monkeypatch, loaded, reference):
    """Blocks folded column-major instead of row-major change the image tokens' logits."""
    model, processor = loaded(FAMILY, "hub")

    def transposed(patches, rows, columns, factor):
        D = patches.shape[-1]
        blocks = patches.reshape(rows // factor, factor, columns // factor, factor, D)
        return blocks.transpose(0, 2, 3, 1, 4).reshape(-1, factor * factor * D)

    monkeypatch.setattr(lfm2_vl, "unshuffle", transposed)
    with no_feature_cache():  # features of the patched model must not be kept
        _, logits = our_logits(model, processor, *CASES["one_image"])
    assert np.abs(logits - reference(FAMILY, "one_image").logits).max() > 100 * LOGITS_ATOL


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads both into the same model."""
    ref = reference(FAMILY, "two_images")
    for layout in LAYOUTS:
        path = tiny_checkpoints.path(FAMILY, layout)
        processor = lfm2_vl.load_processor(path, {"model_type": FAMILY})
        logits = transformers_logits(load_transformers_model(path), processor, *CASES["two_images"])
        np.testing.assert_array_equal(logits, ref.logits)


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == new
    assert hub.text.layer_types == ["conv", "full_attention", "conv", "full_attention"]


def test_first_configs_spellings_read_the_same(tiny_checkpoints):
    """LiquidAI's first configs: model_type "lfm2-vl" and image_token_index."""
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    first = {**config, "model_type": "lfm2-vl", "image_token_index": config.pop("image_token_id")}
    assert get_family("lfm2-vl") is lfm2_vl
    assert lfm2_vl.Model.from_config(first).args == lfm2_vl.Model.from_config(
        read_config(tiny_checkpoints, FAMILY, "hub")).args


def test_sanitized_names_are_mlx_community_names(tiny_checkpoints, loaded):
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        weights = mx.load(str(tiny_checkpoints.path(FAMILY, layout) / "model.safetensors"))
        assert lfm2_vl.is_hf_checkpoint(weights.keys())
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected
        assert not lfm2_vl.is_hf_checkpoint(sanitized.keys())
    for name in (
        "vision_tower.embeddings.patch_embedding.weight",
        "vision_tower.embeddings.position_embedding.weight",
        "vision_tower.encoder.layers.1.self_attn.out_proj.weight",
        "vision_tower.encoder.layers.1.mlp.fc2.weight",
        "vision_tower.post_layernorm.weight",
        "multi_modal_projector.layer_norm.weight",
        "multi_modal_projector.linear_1.weight",
        "multi_modal_projector.linear_2.bias",
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.0.conv.conv.weight",
        "language_model.model.layers.0.conv.in_proj.weight",
        "language_model.model.layers.0.conv.out_proj.weight",
        "language_model.model.layers.1.self_attn.q_layernorm.weight",
        "language_model.model.layers.1.self_attn.out_proj.weight",
        "language_model.model.layers.1.feed_forward.w1.weight",
        "language_model.model.layers.1.operator_norm.weight",
        "language_model.model.embedding_norm.weight",
    ):
        assert name in expected, name
    conv = sanitized["language_model.model.layers.0.conv.conv.weight"]
    assert conv.shape == (64, 3, 1)  # MLX's depthwise Conv1d layout


def test_an_mlx_layout_checkpoint_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    model, _ = loaded(FAMILY, "hub")
    mlx_model, processor = load(save_as_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path))
    _, logits = our_logits(mlx_model, processor, *CASES["two_images"])
    np.testing.assert_allclose(logits, reference(FAMILY, "two_images").logits, rtol=0,
                               atol=LOGITS_ATOL)
