"""LLaVA 1.5, LLaVA-NeXT and LLaVA-OneVision against transformers (float32), on tiny random checkpoints.

Every family is loaded from both config layouts (transformers 5's and llava-hf's older
one, see tests/tiny/llava.py) through ``mlxvlm.load`` and compared with the in-memory
transformers model the checkpoint was saved from, whose inputs come from a processor
built independently of mlxvlm's: logits of the first forward pass, and greedy tokens
through ``mlxvlm.stream_generate`` — for text only, one image, two images of different
aspect ratios (so that AnyRes picks different tile grids), and an image in a later turn.
The reference's inputs are ``apply_chat_template(tokenize=True)``'s, which passes the
images nested per prompt (OneVision tiles an image only when it is alone in its prompt).
Guards check that the tests can fail: another image changes the output, the wrong rope θ
changes the logits, the AnyRes cases really unpad and shrink, and the reference's greedy
steps are not decided by razor-thin logit margins.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from parity import (  # noqa: F401  (loaded is a fixture)
    assert_another_image_changes_the_output,
    assert_patch_weight_is_channels_last,
    assert_wrong_model_is_caught,
    load_transformers_model,
    loaded,
    parameter_list,
    our_logits,
    our_tokens,
    read_config,
    reference_fixture,
    standard_cases,
    standard_parity_tests,
    transformers_logits,
)
from tiny import make_image
from tiny.llava import FAMILIES, LAYOUTS, build_processor, hub_name
from mlxvlm import load
from mlxvlm.errors import CheckpointError
from mlxvlm.models import get_family
from mlxvlm.models.layers import anyres

torch = pytest.importorskip("torch")

# Landscape: NeXT tiles it 2 x 2 and unpads rows; OneVision 3 x 4, then shrinks the map.
IMAGE_A = make_image(168, 126, seed=1)
IMAGE_B = make_image(40, 120, seed=2)  # tall: both tile it 3 x 1
IMAGE_A2 = make_image(168, 126, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_B, IMAGE_A2)
FAMILY_LAYOUTS = [(f, layout) for f in FAMILIES for layout in LAYOUTS]


# --------------------------------------------------------------------------------- helpers


# (family, case) -> transformers' side of the case, with inputs from a processor built
# from the fixture's in-memory parts (not mlxvlm's).
reference = reference_fixture(build_processor)


def ours(run, model, processor, case: str, **options):
    messages, images = ALL_CASES[case]
    return run(model, processor, messages, images, **options)


# ----------------------------------------------------------------------------------- parity


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests(FAMILY_LAYOUTS, CASES)
)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_gives_the_same_tokens(family, loaded, reference):
    """Chunks of 3 tokens split the images' placeholder runs."""
    model, processor = loaded(family, "hub")
    assert ours(our_tokens, model, processor, "two_images", prefill_step_size=3) == (
        reference(family, "two_images").tokens
    )


# ---------------------------------------------------------------- the tests can fail


@pytest.mark.parametrize("family", FAMILIES)
def test_another_image_changes_the_output(family, loaded, reference):
    """(The one-image case itself is matched token for token above.)"""
    model, processor = loaded(family, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, family, reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_rope_theta_would_be_caught(family, tiny_checkpoints, loaded, reference):
    """The fixture's θ is not the default, so a loader missing the hub's key fails parity."""
    config = read_config(tiny_checkpoints, family, "hub")
    del config["text_config"]["rope_theta"]
    model, processor = loaded(family, "hub")
    assert_wrong_model_is_caught(get_family(family).Model.from_config(config), model, processor,
                                 CASES["image_in_second_turn"], reference(family, "image_in_second_turn"))


@pytest.mark.parametrize("family,grid_a,kept_a,shrunk_a", [
    ("llava_next", (2, 2), (4, 6), (4, 6)),
    ("llava_onevision", (3, 4), (9, 12), (7, 10)),
])
def test_anyres_cases_pick_different_grids_unpad_and_shrink(
    family, grid_a, kept_a, shrunk_a, tiny_checkpoints, loaded
):
    """The AnyRes cases' images are tiled differently; NeXT unpads A's map, OneVision
    shrinks it (more than 9 tiles' worth of patches)."""
    config = tiny_checkpoints.model(family).model.config
    tile, pinpoints = config.vision_config.image_size, config.image_grid_pinpoints
    size_a, size_b = (IMAGE_A.height, IMAGE_A.width), (IMAGE_B.height, IMAGE_B.width)
    assert anyres.tile_grid(size_a, pinpoints, tile) == grid_a
    assert anyres.tile_grid(size_b, pinpoints, tile) == (3, 1)
    side = tile // config.vision_config.patch_size
    kept = anyres.unpad(mx.zeros((grid_a[0] * side, grid_a[1] * side, 1)), size_a)
    assert kept.shape[:2] == kept_a
    model, _ = loaded(family, "hub")
    assert model.shrink(kept).shape[:2] == shrunk_a


def test_bilinear_resize_matches_torch():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(9, 12, 5)).astype(np.float32)
    for size in ((7, 10), (4, 5), (9, 3)):
        expected = torch.nn.functional.interpolate(
            torch.from_numpy(features).permute(2, 0, 1)[None], list(size), mode="bilinear"
        )[0].permute(1, 2, 0).numpy()
        resized = np.array(anyres.resize_bilinear(mx.array(features), *size))
        np.testing.assert_allclose(resized, expected, rtol=0, atol=1e-5)  # float32 rounding


# -------------------------------------------------------------- checkpoints and names


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_layout_reads_the_same_in_transformers(family, tiny_checkpoints, reference):
    """The hub fixture is faithful: transformers reads it into the same model. (The other
    layout's config and tensors are save_pretrained's own.)"""
    ref_logits = reference(family, "one_image").logits
    processor = build_processor(tiny_checkpoints.model(family))
    messages, images = CASES["one_image"]
    model = load_transformers_model(tiny_checkpoints.path(family, "hub"))
    assert model.config.text_config.rope_parameters["rope_theta"] != 10000.0
    np.testing.assert_array_equal(transformers_logits(model, processor, messages, images), ref_logits)


@pytest.mark.parametrize("family,vision_act", [
    ("llava", "quick_gelu"), ("llava_next", "quick_gelu"), ("llava_onevision", "gelu_pytorch_tanh"),
])
def test_both_config_layouts_build_the_same_model(family, vision_act, tiny_checkpoints):
    Model = get_family(family).Model
    hub_config = read_config(tiny_checkpoints, family, "hub")
    assert "hidden_act" not in hub_config["vision_config"]
    assert "rms_norm_eps" not in hub_config["text_config"]
    hub = Model.from_config(hub_config).args
    assert hub == Model.from_config(read_config(tiny_checkpoints, family, "transformers")).args
    # the values the hub's sub-configs leave to the classes' defaults
    assert hub.text.rms_norm_eps == 1e-6 and hub.vision.hidden_act == vision_act


@pytest.mark.parametrize("family", FAMILIES)
def test_sanitized_names_are_mlx_community_names(family, tiny_checkpoints, loaded):
    """Every Hugging Face naming maps onto the names mlx-community's checkpoints use."""
    module = get_family(family)
    model, _ = loaded(family, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    state = tiny_checkpoints.model(family).model.state_dict()
    namings = {
        "hub": mx.load(str(tiny_checkpoints.path(family, "hub") / "model.safetensors")),
        "save_pretrained": mx.load(str(tiny_checkpoints.path(family, "transformers") / "model.safetensors")),
        "module_tree": {name: mx.array(value.numpy()) for name, value in state.items()},
    }
    tied = model.args.text.tie_word_embeddings
    assert set(namings["hub"]) == {hub_name(n) for n in state if not (tied and n == "lm_head.weight")}
    for naming, weights in namings.items():
        assert module.is_hf_checkpoint(weights.keys()), naming
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected, naming
    names = {
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.1.self_attn.q_proj.weight",
        "multi_modal_projector.linear_1.bias",
        "multi_modal_projector.linear_2.weight",
        "vision_tower.vision_model.embeddings.position_embedding.weight",
        "vision_tower.vision_model.encoder.layers.2.self_attn.out_proj.bias",
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "vision_tower.vision_model.post_layernorm.bias",
    }
    if family == "llava_onevision":  # SigLIP; tied embeddings
        names |= {"vision_tower.vision_model.embeddings.patch_embedding.bias", "image_newline",
                  "language_model.model.layers.1.self_attn.q_proj.bias"}
        assert "language_model.lm_head.weight" not in expected
    else:  # CLIP
        names |= {"vision_tower.vision_model.embeddings.class_embedding",
                  "vision_tower.vision_model.pre_layrnorm.weight", "language_model.lm_head.weight"}
        names |= {"image_newline"} if family == "llava_next" else set()
    assert names <= expected, names - expected
    assert_patch_weight_is_channels_last(
        sanitized, "vision_tower.vision_model.embeddings.patch_embedding.weight", model.args.vision
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_community_checkpoints_load_unchanged(family, tiny_checkpoints, loaded, tmp_path):
    """MLX conversions (mlx-community's: our names, the Hub's config, safetensors metadata
    ``{"format": "mlx"}``) load as they are, quantized or not — an unquantized one has the
    Hub original's names, so only that metadata (or mlxvlm.convert's config marker) tells.
    Without either, such names are taken for the Hub's and a wrong guess fails loudly."""
    source = tiny_checkpoints.path(family, "hub")
    model, processor = loaded(family, "hub")

    def converted(name: str, weights: dict, metadata: dict | None = None, **config_changes):
        target = tmp_path / name
        shutil.copytree(source, target)
        mx.save_safetensors(str(target / "model.safetensors"), weights, metadata=metadata)
        config = {**json.loads((target / "config.json").read_text()), **config_changes}
        (target / "config.json").write_text(json.dumps(config))
        return target

    mlx_format = {"format": "mlx"}
    quantized = get_family(family).Model.from_config(read_config(tiny_checkpoints, family, "hub"))
    quantized.load_weights(parameter_list(model))
    nn.quantize(quantized.language_model, group_size=32, bits=8)
    weights = dict(tree_flatten(quantized.parameters()))
    again, again_processor = load(
        converted("quantized", weights, mlx_format, quantization={"group_size": 32, "bits": 8})
    )
    _, expected = ours(our_logits, quantized, processor, "one_image")
    # Loaded, it runs on the CPU fast paths (float32 BLAS), so equal to rounding.
    np.testing.assert_allclose(ours(our_logits, again, again_processor, "one_image")[1], expected,
                               rtol=1e-4, atol=1e-4)

    _, expected = ours(our_logits, model, processor, "one_image")
    plain = dict(tree_flatten(model.parameters()))
    for name, metadata, marker in (("mlx-community", mlx_format, {}),
                                   ("mlxvlm-convert", mlx_format, {"mlxvlm_format": 1})):
        again, again_processor = load(converted(name, plain, metadata, **marker))
        np.testing.assert_array_equal(ours(our_logits, again, again_processor, "one_image")[1], expected)
    with pytest.raises(CheckpointError, match="do not match"):
        load(converted("unmarked", plain))


TORCH_FREE_PROCESSING = """
import json, sys
sys.modules["torch"] = sys.modules["torchvision"] = None  # as on an install without them
from PIL import Image
from mlxvlm.prompt import prepare_inputs
from mlxvlm.checkpoint.loading import read_config
from mlxvlm.models import get_family
from pathlib import Path
messages = json.loads(sys.argv[1])
images = [Image.open(p) for p in json.loads(sys.argv[2])]
ids = {}
for path in sys.argv[3:]:
    config = read_config(Path(path))
    processor = get_family(config["model_type"]).load_processor(path, config)
    ids[path] = prepare_inputs(processor, messages, images).input_ids[0].tolist()
print(json.dumps(ids))
"""


def test_processors_are_built_without_torch(tiny_checkpoints, reference, tmp_path):
    """Every family's processor, from either layout, in a process where torch and
    torchvision cannot be imported, tokenizes the two-image case as the reference did."""
    import subprocess
    import sys
    from pathlib import Path

    messages, images = CASES["two_images"]
    image_paths = []
    for i, image in enumerate(images):
        image_paths.append(str(tmp_path / f"{i}.png"))
        image.save(image_paths[-1])
    paths = {str(tiny_checkpoints.path(f, layout)): f for f, layout in FAMILY_LAYOUTS}
    root = Path(__file__).parent.parent
    result = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_PROCESSING, json.dumps(messages), json.dumps(image_paths),
         *paths],
        capture_output=True, text=True, cwd=root, env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ids = json.loads(result.stdout.strip().splitlines()[-1])
    for path, family in paths.items():
        assert ids[path] == reference(family, "two_images").input_ids, path


def test_pixtral_tower_checkpoints_are_handed_to_the_pixtral_family(tiny_checkpoints, tmp_path):
    """mistral-community/pixtral-12b says ``model_type: llava``: load gives the pixtral
    family's model and processor, with its logits."""
    from tiny.pixtral import llava_config

    source = tiny_checkpoints.path("pixtral", "hub")
    path = tmp_path / "pixtral-as-llava"
    shutil.copytree(source, path)
    (path / "config.json").write_text(json.dumps(llava_config(path)))
    model, processor = load(path)
    expected_model, expected_processor = load(source)
    assert type(model) is type(expected_model) and type(processor) is type(expected_processor)
    messages, images = CASES["one_image"]
    np.testing.assert_array_equal(
        our_logits(model, processor, messages, images)[1],
        our_logits(expected_model, expected_processor, messages, images)[1],
    )


def test_mistral_sliding_window_bounds_the_context(tiny_checkpoints):
    """mlx-lm's llama cannot slide on every layer, so a Mistral window becomes the context
    (full attention equals sliding attention while everything fits in the window)."""
    config = read_config(tiny_checkpoints, "llava_next", "hub")
    config["text_config"]["sliding_window"] = 40
    model = get_family("llava_next").Model.from_config(config)
    assert model.max_context == 40
    config["text_config"].pop("sliding_window")  # the class default (4096) applies
    assert get_family("llava_next").Model.from_config(config).max_context == 1024
