"""DeepSeek-OCR 2 (``deepseek_ocr2``) against transformers' DeepseekOcr2ForConditionalGeneration
(float32, PIL processor), on a tiny random checkpoint (tests/tiny/deepseek_ocr2.py) in the
Hub's original tensor names and in transformers 5's.

Parity: first-pass logits within 1e-4 and 24 greedy tokens for text, one page (a global
view and two tiles), two images (one with tiles, one without) and an image in a later
turn; 64 greedy tokens for the model card's prompts ("Free OCR.", "<|grounding|>Convert
the document to markdown."), also with prompt lookup drafting; the same answers through
the CLI's ``main`` (24 and 64 tokens) and through ``python -m mlxvlm.server`` (two
requests decoded together, then a later turn reusing the cached prefix).
Prompts: the model card's plain prompts are what a user turn renders to, token for token.
Guards: another image changes the answer, a wrong text rope θ is caught; the Hub layout
fixture is what transformers reads.
"""

from __future__ import annotations

import functools
import json
import shutil

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
    parameter_list,
    read_config,
    reference_fixture,
    standard_cases,
    standard_parity_tests,
    transformers_logits,
)
from tiny import make_image
from tiny.deepseek_ocr2 import reference_processor
from mlxvlm import load
from mlxvlm.models import get_family

torch = pytest.importorskip("torch")

FAMILY = "deepseek_ocr2"
OCR_TOKENS = 64  # an OCR answer copies the page: long
IMAGE_A = make_image(260, 130, seed=1)  # wider than a 192-px tile: 2 x 1 tiles + global
IMAGE_B = make_image(150, 170, seed=2)  # within one tile: the global view alone
IMAGE_A2 = make_image(260, 130, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_B, IMAGE_A2)
# the model card's prompts, each after its page
OCR_PROMPTS = {
    "free_ocr": "Free OCR.",
    "grounding_markdown": "<|grounding|>Convert the document to markdown.",
}
OCR_CASES = {
    "free_ocr": (parity.user(None, OCR_PROMPTS["free_ocr"]), [IMAGE_A]),
    "grounding_markdown": (parity.user(None, OCR_PROMPTS["grounding_markdown"]), [IMAGE_B]),
}
ALL_CASES.update(OCR_CASES)

reference = reference_fixture(reference_processor)

test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests([(FAMILY, "hub")], CASES)
)


@pytest.fixture(scope="module")
def ocr_reference(tiny_checkpoints):
    """case -> transformers' ``Reference`` with OCR_TOKENS greedy tokens."""

    @functools.cache
    def run(case: str) -> parity.Reference:
        tiny = tiny_checkpoints.model(FAMILY)
        ref = parity.reference_run(tiny.model, reference_processor(tiny), *ALL_CASES[case],
                                   new_tokens=OCR_TOKENS)
        assert len(ref.tokens) == OCR_TOKENS, "the reference stopped early; pick another seed"
        assert ref.margin > parity.MIN_REFERENCE_MARGIN, f"margin {ref.margin:.2e} is too thin"
        return ref

    return run


def reference_text(processor, ref) -> str:
    return processor.tokenizer.decode(ref.tokens, skip_special_tokens=True)


def test_transformers_layout_matches_too(loaded, reference):
    """transformers 5's names (fused experts) load into the same model."""
    model, processor = loaded(FAMILY, "transformers")
    parity.assert_first_pass_matches(model, processor, CASES["two_images"],
                                     reference(FAMILY, "two_images"))


# ------------------------------------------------------------------ the model card's prompts


@pytest.mark.parametrize("case", OCR_CASES)
def test_model_card_prompts_are_the_users_text_unchanged(case, loaded):
    """A user turn with a page and the model card's prompt tokenizes exactly as the model
    card's call, ``processor(images=page, text="<image>\\n" + prompt)``: on the Hub layout,
    which has no chat template, through the one the family gives it."""
    from mlxvlm.prompt import prepare_inputs

    model, processor = loaded(FAMILY, "hub")
    messages, images = OCR_CASES[case]
    ours = prepare_inputs(processor, messages, images, feature_names=model.feature_names)
    card = processor(images=images, text="<image>\n" + OCR_PROMPTS[case], return_tensors="np")
    assert ours.prompt_text == "<image>\n" + OCR_PROMPTS[case]
    assert ours.input_ids[0].tolist() == card["input_ids"][0].tolist()
    assert ours.input_ids[0, 0].item() == processor.tokenizer.bos_token_id
    for name in ("pixel_values", "pixel_values_local", "num_local_patches"):
        if name in card:
            np.testing.assert_array_equal(np.array(ours.features[name]), card[name])


@pytest.mark.parametrize("case", OCR_CASES)
def test_model_card_prompts_match_transformers_for_64_tokens(case, loaded, ocr_reference):
    model, processor = loaded(FAMILY, "hub")
    ref = ocr_reference(case)
    parity.assert_first_pass_matches(model, processor, ALL_CASES[case], ref)
    assert parity.our_tokens(model, processor, *ALL_CASES[case], max_tokens=OCR_TOKENS) == ref.tokens


def test_prompt_lookup_keeps_the_64_token_answer(loaded, ocr_reference):
    """Prompt lookup drafting verifies every draft against the model: the greedy answer
    stays transformers'."""
    from mlxvlm import stream_generate

    model, processor = loaded(FAMILY, "hub")
    ref = ocr_reference("free_ocr")
    steps = list(stream_generate(model, processor, *ALL_CASES["free_ocr"], max_tokens=OCR_TOKENS,
                                 temperature=0.0, prompt_lookup_num_tokens=4))
    assert [step.token for step in steps if step.token is not None] == ref.tokens
    stats = steps[-1].speculation
    assert stats.drafted >= stats.accepted and stats.drafted > 0


# --------------------------------------------------------------------- entry points


@pytest.mark.parametrize("prompt,case,tokens", [
    ("Describe this image.", "one_image", parity.NEW_TOKENS),
    ("Free OCR.", "free_ocr", OCR_TOKENS),
])
def test_cli_prints_the_reference_answer(prompt, case, tokens, tmp_path, capsys, tiny_checkpoints,
                                         loaded, reference, ocr_reference):
    """``python -m mlxvlm.generate``'s main: a picture file and a prompt, greedy."""
    from mlxvlm.generate.__main__ import main

    image = tmp_path / "page.png"
    ALL_CASES[case][1][0].save(image)
    ref = reference(FAMILY, case) if tokens == parity.NEW_TOKENS else ocr_reference(case)
    code = main(["--model", str(tiny_checkpoints.path(FAMILY, "hub")), "--image", str(image),
                 "--prompt", prompt, "--max-tokens", str(tokens), "--temperature", "0"])
    assert code in (0, None)
    _, processor = loaded(FAMILY, "hub")
    assert capsys.readouterr().out.rstrip("\n") == reference_text(processor, ref)


def test_cli_reads_a_pdf_page_by_page_into_markdown_files(tmp_path, tiny_checkpoints,
                                                         loaded, ocr_reference):
    """``--pdf`` with ``--output-dir``: each page, rendered at 72 DPI, answered in turn
    with the model card's prompt into its own Markdown file -- transformers' answer on
    that rendered page."""
    import io

    from mlxvlm.generate.__main__ import main
    from mlxvlm.media.pdf import iter_pdf_pages, open_pdf

    pdf = tmp_path / "scan.pdf"
    buffer = io.BytesIO()
    IMAGE_A.save(buffer, "PDF", save_all=True, append_images=[IMAGE_B], resolution=72)
    pdf.write_bytes(buffer.getvalue())
    document = open_pdf(pdf)
    try:
        pages = dict(iter_pdf_pages(document, [1, 2], dpi=72))
    finally:
        document.close()
    tiny = tiny_checkpoints.model(FAMILY)
    _, processor = loaded(FAMILY, "hub")
    out = tmp_path / "pages"
    code = main(["--model", str(tiny_checkpoints.path(FAMILY, "hub")), "--pdf", str(pdf),
                 "--dpi", "72", "--prompt", "Free OCR.", "--max-tokens", str(parity.NEW_TOKENS),
                 "--temperature", "0", "--output-dir", str(out)])
    assert code in (0, None)
    assert sorted(p.name for p in out.iterdir()) == ["page-001.md", "page-002.md"]
    for number, page in pages.items():
        ref = parity.reference_run(tiny.model, reference_processor(tiny),
                                   parity.user(None, "Free OCR."), [page])
        parity.assert_reference_is_decisive(ref)
        assert (out / f"page-{number:03d}.md").read_text() == reference_text(processor, ref) + "\n"


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
        "free_ocr": ([user("Free OCR.", png_data_url(IMAGE_A))], OCR_TOKENS),
        "text": ([{"role": "user", "content": CASES["text"][0][0]["content"]}], parity.NEW_TOKENS),
    }
    expected = {"free_ocr": ocr_reference("free_ocr"), "text": reference(FAMILY, "text")}
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


def test_sampling_defaults_come_from_generation_config(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints.path(FAMILY, "hub")
    path = tmp_path / "checkpoint"
    shutil.copytree(source, path)
    config = json.loads((path / "generation_config.json").read_text())
    written = {"do_sample": True, "temperature": 0.6, "top_p": 0.85, "top_k": 20}
    (path / "generation_config.json").write_text(json.dumps({**config, **written}))
    _, processor = load(path)
    defaults = processor.sampling_defaults.values
    assert {k: defaults[k] for k in ("temperature", "top_p", "top_k")} == {
        k: written[k] for k in ("temperature", "top_p", "top_k")}


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


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers renames its original names into
    the same model."""
    path = tiny_checkpoints.path(FAMILY, "hub")
    processor = get_family(FAMILY).load_processor(path, {})
    logits = transformers_logits(load_transformers_model(path), processor, *CASES["one_image"])
    np.testing.assert_allclose(logits, reference(FAMILY, "one_image").logits, rtol=0, atol=1e-6)


def test_both_layouts_sanitize_to_the_same_names(tiny_checkpoints, loaded):
    module = get_family(FAMILY)
    model, _ = loaded(FAMILY, "hub")
    expected = {name for name, _ in parameter_list(model)}
    for layout in ("hub", "transformers"):
        weights = mx.load(str(tiny_checkpoints.path(FAMILY, layout) / "model.safetensors"))
        assert module.is_hf_checkpoint(weights.keys())
        sanitized = module.Model.from_config(read_config(tiny_checkpoints, FAMILY, layout)).sanitize(weights)
        assert set(sanitized) == expected, layout
    for name in ("sam_model.blocks.1.attn.rel_pos_h", "sam_model.neck.3.bias", "sam_model.net_3.weight",
                 "sam_model.patch_embed.proj.weight", "view_separator",
                 "vision_model.qwen2_encoder.query_1024", "vision_model.qwen2_encoder.layers.1.self_attn.q_proj.bias",
                 "projector.layers.bias",
                 "language_model.model.layers.1.mlp.switch_mlp.gate_proj.weight",
                 "language_model.model.layers.1.mlp.shared_experts.up_proj.weight",
                 "language_model.model.layers.0.mlp.gate_proj.weight"):
        assert name in expected, name


def test_an_mlx_layout_checkpoint_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    """What a conversion of ours writes (our names, ``format: mlx``) loads as it is."""
    model, _ = loaded(FAMILY, "hub")
    path = parity.save_as_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path)
    mlx_model, processor = load(path)
    _, logits = parity.our_logits(mlx_model, processor, *CASES["one_image"])
    np.testing.assert_allclose(logits, reference(FAMILY, "one_image").logits, rtol=0, atol=LOGITS_ATOL)


def deepseek_layout_config(config: dict) -> dict:
    """The tiny config as DeepSeek's own config.json spells it (deepseek-ai/DeepSeek-OCR-2,
    kept by mlx-community's conversions under ``model_type`` "deepseekocr_2"), with the
    tiny sizes DeepSeek's file leaves to the code (SAM's patch and window, the query
    encoder's depth and heads, SAM's MLP ratio and neck width) in the ``width`` entries beside the sizes
    DeepSeek's file gives there."""
    text, vision = config["text_config"], config["vision_config"]
    sam, encoder = vision["sam_config"], vision["encoder_config"]
    language = {k: text[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_routed_experts",
        "n_shared_experts", "num_experts_per_tok", "max_position_embeddings", "rms_norm_eps",
        "bos_token_id", "eos_token_id")}
    language.update(first_k_dense_replace=text["mlp_layer_types"].index("sparse"), moe_layer_freq=1,
                    rope_theta=text["rope_parameters"]["rope_theta"], topk_method="greedy",
                    n_group=1, topk_group=1, use_mla=False, qk_nope_head_dim=0, qk_rope_head_dim=0,
                    kv_lora_rank=None, q_lora_rank=None, model_type="deepseek_v2")
    return {
        "model_type": "deepseekocr_2", "architectures": ["DeepseekOCR2ForCausalLM"],
        "language_config": language,
        "vision_config": {"image_size": sam["image_size"], "model_type": "vision", "width": {
            "sam_vit_b": {"width": sam["hidden_size"], "layers": sam["num_hidden_layers"],
                          "heads": sam["num_attention_heads"],
                          "global_attn_indexes": sam["global_attn_indexes"],
                          "downsample_channels": [sam["downsample_channels"][0], 1024],
                          "patch_size": sam["patch_size"], "window_size": sam["window_size"],
                          "mlp_ratio": sam["mlp_dim"] / sam["hidden_size"],
                          "out_chans": sam["output_channels"]},
            "qwen2-0-5b": {"dim": encoder["hidden_size"], "layers": encoder["num_hidden_layers"],
                           "heads": encoder["num_attention_heads"],
                           "kv_heads": encoder["num_key_value_heads"],
                           "intermediate_size": encoder["intermediate_size"],
                           "rope_theta": encoder["rope_parameters"]["rope_theta"]}}},
        "projector_config": {"projector_type": "linear", "input_dim": encoder["hidden_size"],
                             "n_embed": text["hidden_size"]},
        "image_token_index": config["image_token_id"], "tile_tag": "2D", "global_view_pos": "head",
    }


def test_mlx_community_layout_loads(tmp_path, tiny_checkpoints, loaded, reference):
    """mlx-community's conversions (mlx-vlm's): DeepSeek's own config (``deepseekocr_2``),
    tensors under DeepSeek's names without the ``model.`` level (``sam_model.blocks.N``,
    ``vision_model.qwen2_encoder``, ``projector.layers``, ``view_separator``) and mlx-lm's
    expert banks, in MLX's layout -- ours."""
    model, _ = loaded(FAMILY, "hub")
    path = parity.save_as_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path)
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    (path / "config.json").write_text(json.dumps(deepseek_layout_config(config)))
    mlx_model, processor = load(path)
    assert type(mlx_model) is get_family(FAMILY).Model
    parity.assert_first_pass_matches(mlx_model, processor, CASES["two_images"],
                                     reference(FAMILY, "two_images"))
