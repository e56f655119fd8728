"""GLM-OCR (``glm_ocr``) against transformers' GlmOcrForConditionalGeneration (float32,
PIL processor), on a tiny random checkpoint in both layouts (tests/tiny/glm_ocr.py).

Parity: first-pass logits within 1e-4 and 24 greedy tokens for text, one image, two
images of different aspect ratios and an image in a later turn; 64 greedy tokens for the
model card's task prompts ("Text Recognition:", "Table Recognition:", "Formula
Recognition:") as plain user text, also with prompt lookup drafting; chunked prefill; the same answers through the CLI's
``main`` (24 and 64 tokens) and through ``python -m mlxvlm.server`` (two requests
decoded together, then a later turn reusing the cached prefix); video frames placed as
transformers places them.
Guards: another image changes the answer, a wrong rope θ or GLM-4.6V's defaults for
missing keys are caught, the multi-token-prediction layer is left out.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

import parity
from parity import (
    LOGITS_ATOL,
    assert_another_image_changes_the_output,
    assert_wrong_model_is_caught,
    load_transformers_model,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    our_tokens,
    parameter_list,
    read_config,
    reference_fixture,
    standard_cases,
    standard_parity_tests,
    transformers_logits,
)
from tiny import make_image
from tiny.glm_ocr import HEAD_DIM, LAYOUTS, reference_processor
from mlxvlm import load
from mlxvlm.models import get_family

torch = pytest.importorskip("torch")

FAMILY = "glm_ocr"
OCR_TOKENS = 64  # an OCR answer copies the page: long
IMAGE_A = make_image(112, 84, seed=1)  # 6 x 8 patches of 14 px -> 12 tokens
IMAGE_B = make_image(56, 98, seed=2)  # a tall one -> 8 tokens
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_B, IMAGE_A2)
# the model card's task prompts, each after its image
OCR_CASES = {
    "text_recognition": (parity.user(None, "Text Recognition:"), [IMAGE_A]),
    "table_recognition": (parity.user(None, "Table Recognition:"), [IMAGE_B]),
    "formula_recognition": (parity.user(None, "Formula Recognition:"), [IMAGE_A2]),
}
ALL_CASES.update(OCR_CASES)

reference = reference_fixture(reference_processor)

test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests([(FAMILY, layout) for layout in LAYOUTS], CASES)
)


@pytest.fixture(scope="module")
def ocr_reference(tiny_checkpoints):
    """case -> transformers' ``Reference`` with OCR_TOKENS greedy tokens."""

    @functools.cache
    def run(case: str) -> parity.Reference:
        tiny = tiny_checkpoints.model(FAMILY)
        return parity.reference_run(tiny.model, reference_processor(tiny), *ALL_CASES[case],
                                    new_tokens=OCR_TOKENS)

    return run


def decisive_ocr_reference(ocr_reference, case: str) -> parity.Reference:
    ref = ocr_reference(case)
    assert len(ref.tokens) == OCR_TOKENS, "the reference stopped early; pick another seed"
    assert ref.margin > parity.MIN_REFERENCE_MARGIN, f"margin {ref.margin:.2e} is too thin"
    return ref


def reference_text(processor, ref) -> str:
    return processor.tokenizer.decode(ref.tokens, skip_special_tokens=True)


# ------------------------------------------------------------------ the task prompts


@pytest.mark.parametrize("case", OCR_CASES)
def test_task_prompts_match_transformers_for_64_tokens(case, loaded, ocr_reference):
    model, processor = loaded(FAMILY, "hub")
    ref = decisive_ocr_reference(ocr_reference, case)
    parity.assert_first_pass_matches(model, processor, ALL_CASES[case], ref)
    assert our_tokens(model, processor, *ALL_CASES[case], max_tokens=OCR_TOKENS) == ref.tokens


def test_prompt_lookup_keeps_the_64_token_answer(loaded, ocr_reference):
    """Prompt lookup drafting (what pays on OCR answers, which copy the page) verifies
    every draft against the model: the greedy answer stays transformers'."""
    from mlxvlm import stream_generate

    model, processor = loaded(FAMILY, "hub")
    ref = decisive_ocr_reference(ocr_reference, "table_recognition")
    steps = list(stream_generate(model, processor, *ALL_CASES["table_recognition"],
                                 max_tokens=OCR_TOKENS, prompt_lookup_num_tokens=4))
    assert [step.token for step in steps if step.token is not None] == ref.tokens
    # drafts were made, and some kept, some thrown away
    stats = steps[-1].speculation
    assert stats.drafted > stats.accepted > 0


def test_chunked_prefill_gives_the_same_tokens(loaded, reference):
    """Chunks of 5 tokens cut through the images' runs."""
    model, processor = loaded(FAMILY, "transformers")
    assert our_tokens(model, processor, *CASES["two_images"], prefill_step_size=5) == (
        reference(FAMILY, "two_images").tokens)


def test_video_frames_in_a_video_block_match_transformers(tiny_checkpoints, loaded):
    """GLM-OCR keeps GLM-V's video path: frames inside a video block take the video's
    features and one 1 x h x w grid each, as in transformers."""
    from test_glm4v_parity import assert_video_block_matches_transformers

    model, processor = loaded(FAMILY, "transformers")
    assert_video_block_matches_transformers(tiny_checkpoints.model(FAMILY).model, model, processor)


# --------------------------------------------------------------------- entry points


@pytest.mark.parametrize("prompt,case,tokens", [
    ("Describe this image.", "one_image", parity.NEW_TOKENS),
    ("Text Recognition:", "text_recognition", OCR_TOKENS),
])
def test_cli_prints_the_reference_answer(prompt, case, tokens, tmp_path, capsys, tiny_checkpoints,
                                         loaded, reference, ocr_reference):
    """``python -m mlxvlm.generate``'s main: a picture file and a prompt, greedy."""
    from mlxvlm.generate.__main__ import main

    image = tmp_path / "page.png"
    ALL_CASES[case][1][0].save(image)
    ref = reference(FAMILY, case) if tokens == parity.NEW_TOKENS else decisive_ocr_reference(ocr_reference, case)
    code = main(["--model", str(tiny_checkpoints.path(FAMILY, "hub")), "--image", str(image),
                 "--prompt", prompt, "--max-tokens", str(tokens), "--temperature", "0"])
    assert code in (0, None)
    _, processor = loaded(FAMILY, "hub")
    assert capsys.readouterr().out.rstrip("\n") == reference_text(processor, ref)


def test_server_entry_point_batches_requests_and_reuses_a_prefix(tiny_checkpoints, loaded,
                                                                 reference, ocr_reference):
    """``python -m mlxvlm.server`` as users start it: a 64-token OCR request and a text one
    in flight at once (one batched decode), then a later turn with an image that reuses
    the first turn's cached prefix; each answer is transformers'."""
    from concurrent.futures import ThreadPoolExecutor

    from server_harness import png_data_url, user
    from server_process import ServerProcess

    _, processor = loaded(FAMILY, "hub")
    requests = {
        "text_recognition": ([user("Text Recognition:", png_data_url(IMAGE_A))], OCR_TOKENS),
        "text": ([{"role": "user", "content": CASES["text"][0][0]["content"]}], parity.NEW_TOKENS),
    }
    expected = {"text_recognition": decisive_ocr_reference(ocr_reference, "text_recognition"),
                "text": reference(FAMILY, "text")}
    with ServerProcess("--model", str(tiny_checkpoints.path(FAMILY, "hub")),
                       "--served-model-name", "ocr") as server:
        client = server.openai_client()

        def ask(request):
            messages, max_tokens = request
            return client.chat.completions.create(model="ocr", messages=messages,
                                                  max_tokens=max_tokens, temperature=0.0)

        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(requests, pool.map(ask, requests.values())))
        for case, answer in answers.items():
            assert answer.choices[0].message.content == reference_text(processor, expected[case])
            assert answer.usage.prompt_tokens == len(expected[case].input_ids)

        messages, images = CASES["image_in_second_turn"]
        first = ask(([messages[0]], parity.NEW_TOKENS))
        later = ask(([messages[0], messages[1],
                      user("What is in this picture?", png_data_url(images[0]))], parity.NEW_TOKENS))
    assert later.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert later.choices[0].message.content == reference_text(
        processor, reference(FAMILY, "image_in_second_turn"))


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "hub")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_wrong_rope_theta_would_be_caught(tiny_checkpoints, loaded, reference):
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    del config["text_config"]["rope_parameters"]["rope_theta"]
    model, processor = loaded(FAMILY, "hub")
    assert_wrong_model_is_caught(get_family(FAMILY).Model.from_config(config), model, processor,
                                 CASES["image_in_second_turn"], reference(FAMILY, "image_in_second_turn"))


def test_missing_keys_take_glm_ocrs_defaults():
    """A config that leaves sizes and token ids out (transformers' save_pretrained drops
    default values) reads GlmOcrConfig's defaults, not GLM-4.6V's."""
    from transformers import GlmOcrConfig

    from mlxvlm.models.glm_ocr import model_args

    expected = GlmOcrConfig()
    args = model_args({"model_type": "glm_ocr", "text_config": {}, "vision_config": {}})
    text, vision = expected.text_config, expected.vision_config
    assert (args.text.hidden_size, args.text.num_hidden_layers, args.text.num_attention_heads,
            args.text.num_key_value_heads, args.text.vocab_size, args.text.intermediate_size,
            args.text.max_position_embeddings) == (
        text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, text.vocab_size, text.intermediate_size,
        text.max_position_embeddings)
    assert (args.vision.hidden_size, args.vision.num_heads, args.vision.out_hidden_size,
            args.vision.mlp_width, args.vision.attention_bias) == (
        vision.hidden_size, vision.num_heads, vision.out_hidden_size, vision.intermediate_size,
        vision.attention_bias)
    assert (args.image_token_id, args.video_token_id, args.video_start_token_id,
            args.video_end_token_id) == (expected.image_token_id, expected.video_token_id,
                                         expected.video_start_token_id, expected.video_end_token_id)


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it (ignoring its
    multi-token-prediction layer) into the same model."""
    path = tiny_checkpoints.path(FAMILY, "hub")
    processor = get_family(FAMILY).load_processor(path, {})
    logits = transformers_logits(load_transformers_model(path), processor, *CASES["one_image"])
    np.testing.assert_allclose(logits, reference(FAMILY, "one_image").logits, rtol=0, atol=1e-6)


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == new
    assert new.text.head_dim == HEAD_DIM != new.text.hidden_size // new.text.num_attention_heads
    assert new.text.rotary_dim == HEAD_DIM and new.text.rotate_pairs
    assert not new.text.attention_bias and not new.text.is_moe
    assert not new.vision.learned_positions and new.vision.qk_norm


def test_sanitized_names_leave_the_prediction_layer_out(tiny_checkpoints, loaded):
    module = get_family(FAMILY)
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        weights = mx.load(str(tiny_checkpoints.path(FAMILY, layout) / "model.safetensors"))
        assert module.is_hf_checkpoint(weights.keys())
        sanitized = module.Model.from_config(read_config(tiny_checkpoints, FAMILY, layout)).sanitize(weights)
        assert set(sanitized) == expected, layout
    assert any(".layers.2." in name for name in weights)  # the hub layout carries it
    for name in ("vision_tower.blocks.1.attn.q_norm.weight", "vision_tower.blocks.1.attn.proj.bias",
                 "vision_tower.blocks.1.mlp.down_proj.bias", "vision_tower.merger.gate_proj.weight",
                 "language_model.model.layers.1.mlp.gate_up_proj.weight"):
        assert name in expected, name
    assert not any(name.startswith("vision_tower.embeddings.") for name in expected)
    assert not any(name.endswith("self_attn.q_proj.bias") for name in expected)


def test_an_mlx_layout_checkpoint_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    """What mlx-community publishes (our names, ``format: mlx``) loads as it is."""
    model, _ = loaded(FAMILY, "hub")
    path = parity.save_as_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path)
    mlx_model, processor = load(path)
    _, logits = parity.our_logits(mlx_model, processor, *CASES["two_images"])
    np.testing.assert_allclose(logits, reference(FAMILY, "two_images").logits, rtol=0, atol=LOGITS_ATOL)

