"""MiniCPM-OCR (``minicpm_ocr``) against transformers' MiniCPMOcrForConditionalGeneration
(float32) and its own processor (``MiniCPMOcrProcessor`` over the torchvision image
processor), on a tiny random checkpoint in both layouts (tests/tiny/minicpm_ocr.py).

Parity: first-pass logits within 1e-4 and 24 greedy tokens for one image (the picture
and 2 x 2 slices), two images (and a wide one's 1 x 3 slices) and an image in a later
turn; 64 greedy tokens for one image, through the API and the CLI; ``python -m
mlxvlm.server`` with two requests decoded together, then a later turn over the cached
prefix; a video clip (MiniCPM-V 4.6's video path, "4x"). The torch-free image processor against transformers' torchvision one
(``small_image_upsize`` "always" and "never"; "adaptive" refused). Guards: another image
changes the answer; MiniCPM-V 4.6's defaults ("16x", untied) for the keys a config
leaves out are caught.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

import parity
from parity import (
    LOGITS_ATOL,
    assert_another_image_changes_the_output,
    loaded,  # noqa: F401 (fixture)
    our_logits,
    our_tokens,
    parameter_list,
    read_config,
    reference_fixture,
    save_as_mlx_checkpoint,
    standard_cases,
    standard_parity_tests,
)
from tiny import make_image
from tiny.minicpm_ocr import HUB_SAMPLING, LAYOUTS, build_image_processor, reference_processor
from mlxvlm import load
from mlxvlm.errors import MlxvlmError
from mlxvlm.models import minicpm_ocr, minicpmv4_6
from mlxvlm.models.feature_cache import no_feature_cache
from mlxvlm.models.minicpm_ocr_images import MiniCPMOcrImageProcessorPil

torch = pytest.importorskip("torch")

FAMILY = "minicpm_ocr"
OCR_TOKENS = 64  # an OCR answer copies the page: long
IMAGE_A = make_image(80, 56, seed=1)  # the picture and 2 x 2 slices
IMAGE_WIDE = make_image(120, 40, seed=2)  # the picture and 1 x 3 slices
IMAGE_A2 = make_image(80, 56, seed=8)  # A's size, other content

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_WIDE, IMAGE_A2)
CASES.pop("text")  # the text model alone is MiniCPM-V 4.6's, checked there and family-wide

reference = reference_fixture(reference_processor)

test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests([(FAMILY, layout) for layout in LAYOUTS], CASES)
)


@pytest.fixture(scope="module")
def ocr_reference(tiny_checkpoints):
    """transformers' one-image ``Reference`` with OCR_TOKENS greedy tokens, decisive."""

    @functools.cache
    def run() -> parity.Reference:
        tiny = tiny_checkpoints.model(FAMILY)
        ref = parity.reference_run(tiny.model, reference_processor(tiny), *CASES["one_image"],
                                   new_tokens=OCR_TOKENS)
        assert len(ref.tokens) == OCR_TOKENS, "the reference stopped early; pick another seed"
        assert ref.margin > parity.MIN_REFERENCE_MARGIN, f"margin {ref.margin:.2e} is too thin"
        return ref

    return run


def reference_text(processor, ref) -> str:
    return processor.tokenizer.decode(ref.tokens, skip_special_tokens=True)


def test_64_greedy_tokens_match_transformers(loaded, ocr_reference):
    model, processor = loaded(FAMILY, "hub")
    assert our_tokens(model, processor, *CASES["one_image"], max_tokens=OCR_TOKENS) == (
        ocr_reference().tokens)


def test_the_views_have_four_times_minicpm_v_tokens(loaded, reference):
    """"4x": each 8 x 8-patch view gives 16 tokens (MiniCPM-V 4.6's "16x": 4)."""
    _, processor = loaded(FAMILY, "hub")
    ids = reference(FAMILY, "two_images").input_ids
    tokens = processor.tokenizer.convert_tokens_to_ids
    views = processor.image_processor([IMAGE_A, IMAGE_WIDE])
    assert views["grids"] == [[2, 2], [1, 3]]
    assert ids.count(tokens("<slice>")) == 4 + 3
    assert ids.count(tokens("<|image_pad|>")) == int(np.prod(views["target_sizes"], -1).sum()) // 4


def test_sampling_defaults_come_from_generation_config(loaded):
    _, processor = loaded(FAMILY, "hub")
    assert processor.sampling_defaults.values == HUB_SAMPLING


# ------------------------------------------------------------------- the processor


@pytest.mark.parametrize("upsize", ["always", "never"])
def test_image_processor_is_transformers_torchvision_one(upsize):
    """Views, grids and pixels as transformers' ``MiniCPMOcrImageProcessor`` gives them,
    for pictures sliced, not sliced (smaller than a slice: upscaled or kept) and tiny."""
    ours = MiniCPMOcrImageProcessorPil(**{**build_image_processor().to_dict(),
                                          "small_image_upsize": upsize})
    theirs = build_image_processor(small_image_upsize=upsize)
    for size in ((80, 56), (120, 40), (20, 30), (33, 9), (300, 200)):
        image = make_image(*size, seed=sum(size))
        a, b = ours(image), theirs(image)
        assert a["grids"] == b["grids"], size
        assert np.asarray(a["target_sizes"]).tolist() == np.asarray(b["target_sizes"]).tolist(), size
        np.testing.assert_allclose(np.asarray(a["pixel_values"]), np.asarray(b["pixel_values"]),
                                   rtol=0, atol=1e-6)
    # 20 x 30 px: upscaled towards 32² px (26 x 39 -> 24 x 40 on the 8-px grid), or kept
    # (-> 16 x 32)
    small = ours(make_image(20, 30, seed=3))["target_sizes"].tolist()
    assert small == ([[10, 6]] if upsize == "always" else [[8, 4]])


def test_adaptive_upsizing_is_refused_clearly(tiny_checkpoints, tmp_path):
    import shutil

    path = shutil.copytree(tiny_checkpoints.path(FAMILY, "hub"), tmp_path / "adaptive")
    settings = json.loads((path / "preprocessor_config.json").read_text())
    settings["small_image_upsize"] = "adaptive"
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    with pytest.raises(MlxvlmError, match="small_image_upsize 'adaptive'.*not supported"):
        load(path)


def test_video_matches_transformers(tiny_checkpoints, loaded, tmp_path):
    """MiniCPM-V 4.6's video path with MiniCPM-OCR's "4x" video processor (16 tokens a
    view): the clip's frames, pixels, logits and 24 greedy tokens are transformers'."""
    from test_minicpmv4_6_parity import assert_video_matches, transformers_video_reference, write_clip

    clip = write_clip(tmp_path)
    batch, ref = transformers_video_reference(tiny_checkpoints, FAMILY, clip)
    model, processor = loaded(FAMILY, "hub")
    assert processor.video_processor.downsample_mode == "4x"
    assert_video_matches(model, processor, clip, batch, ref)


# --------------------------------------------------------------------- entry points


@pytest.mark.parametrize("tokens", [parity.NEW_TOKENS, OCR_TOKENS])
def test_cli_prints_the_reference_answer(tokens, tmp_path, capsys, tiny_checkpoints, loaded,
                                         reference, ocr_reference):
    """``python -m mlxvlm.generate``'s main: a picture file and a prompt, greedy, 24 and
    64 tokens."""
    from mlxvlm.generate.__main__ import main

    if tokens == OCR_TOKENS:
        ref = ocr_reference()  # checked decisive there
    else:
        ref = reference(FAMILY, "one_image")
        parity.assert_reference_is_decisive(ref)
    picture = tmp_path / "page.png"
    IMAGE_A.save(picture)
    code = main(["--model", str(tiny_checkpoints.path(FAMILY, "hub")), "--image", str(picture),
                 "--prompt", "Describe this image.", "--max-tokens", str(tokens),
                 "--temperature", "0"])
    assert code in (0, None)
    _, processor = loaded(FAMILY, "hub")
    assert capsys.readouterr().out.rstrip("\n") == reference_text(processor, ref)


def test_server_entry_point_batches_requests_and_reuses_a_prefix(tiny_checkpoints, loaded, reference):
    """``python -m mlxvlm.server`` as users start it: an image request and a text one in
    flight at once (one batched decode), then the text one's conversation goes on with a
    picture, over the first turn's cached prefix; each answer is transformers'."""
    from concurrent.futures import ThreadPoolExecutor

    from server_harness import png_data_url, user
    from server_process import ServerProcess

    _, processor = loaded(FAMILY, "hub")
    conversation, (picture,) = CASES["image_in_second_turn"]
    requests = {"one_image": [user("Describe this image.", png_data_url(IMAGE_A))],
                "first_turn": [conversation[0]]}
    with ServerProcess("--model", str(tiny_checkpoints.path(FAMILY, "hub")),
                       "--served-model-name", "ocr") as server:
        client = server.openai_client()

        def ask(messages):
            return client.chat.completions.create(model="ocr", messages=messages,
                                                  max_tokens=parity.NEW_TOKENS, temperature=0.0)

        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(requests, pool.map(ask, requests.values())))
        later = ask([*conversation[:2], user("What is in this picture?", png_data_url(picture))])
    assert answers["one_image"].choices[0].message.content == reference_text(
        processor, reference(FAMILY, "one_image"))
    assert later.choices[0].message.content == reference_text(
        processor, reference(FAMILY, "image_in_second_turn"))
    assert later.usage.prompt_tokens_details.cached_tokens >= answers["first_turn"].usage.prompt_tokens


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_minicpm_ocr_defaults_fill_a_sparse_config(tiny_checkpoints, loaded):
    """A config without ``downsample_mode`` and ``tie_word_embeddings`` is read with
    MiniCPMOcrConfig's defaults ("4x", tied), not MiniCPM-V 4.6's ("16x", untied): a
    view's features are transformers' (one token per 2 x 2 patches; the window merger
    would give a quarter of them)."""
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    sparse = {k: v for k, v in config.items() if k not in ("downsample_mode", "tie_word_embeddings")}
    args = minicpm_ocr.Model.from_config(sparse).args
    assert (args.use_window_merger, args.text.tie_word_embeddings) == (False, True)
    wrong = minicpmv4_6.ModelArgs.from_hf(sparse)
    assert (wrong.use_window_merger, wrong.text.tie_word_embeddings) == (True, False)

    reference_model = tiny_checkpoints.model(FAMILY).model.model
    model, _ = loaded(FAMILY, "hub")
    p = model.args.vision.patch_size
    torch.manual_seed(5)
    pixels, sizes = torch.randn(1, 3, p, 8 * 12 * p), torch.tensor([[8, 12]])
    with torch.no_grad():
        expected = reference_model.get_image_features(pixels, sizes).pooler_output[0].numpy()
    with no_feature_cache():
        ours = np.array(model.image_features(pixels.numpy(), sizes.numpy()))
    assert ours.shape[0] == 8 * 12 // 4
    np.testing.assert_allclose(ours, expected, rtol=0, atol=LOGITS_ATOL)


# -------------------------------------------------------------- checkpoints and names


def test_an_mlx_layout_checkpoint_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    """Our names (mlx-community's MiniCPM-V 4.6 names: MiniCPM-OCR's modules are the
    same) load without the Hugging Face mapping."""
    model, _ = loaded(FAMILY, "hub")
    names = {name for name, _ in parameter_list(model)}
    assert "vit_merger.linear_2.weight" in names and "language_model.lm_head.weight" not in names
    mlx_model, processor = load(save_as_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path))
    _, logits = our_logits(mlx_model, processor, *CASES["two_images"])
    np.testing.assert_allclose(logits, reference(FAMILY, "two_images").logits, rtol=0,
                               atol=LOGITS_ATOL)
