"""`python -m mlxvlm.convert` and the loading of every quantization layout, on the tiny
checkpoints of every family that has a builder (tests/tiny/).

Each family is converted to 4 and 8 bits (group sizes 32 and 64), with the mixed recipe,
with its towers quantized, to bfloat16 + 4-bit, and back with ``--dequantize``. The
quantized models are compared with the float one loaded straight from the Hugging Face
checkpoint, the files with the sizes quantization implies.

Tolerances. The tiny random models amplify weight noise a lot (their weights are drawn
with std 0.2 so that they do not ignore their input), so the relative logits error of a
correct quantization is large: measured ~0.03 at 8 bits and ~0.4-0.5 at 4 bits. It grows
with the quantization step (4 bits is ~16x 8 bits, as the step), and saturates at
~1.1 — a model with unrelated weights — when quantization is broken; the guard test
shows that swapped scales land there.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tiny import BUILDERS, builder, make_image
from mlxvlm import load
from mlxvlm.convert import convert, main, write_model_card
from mlxvlm.errors import MlxvlmError
from mlxvlm.checkpoint.loading import CONVERTED_MARKER
from mlxvlm.models import get_family
from mlxvlm.prompt import prepare_inputs
from mlxvlm.checkpoint.quantization import (
    apply_quantization,
    is_multimodal_path,
    read_quantization,
    sensitive_block,
)

FAMILIES = sorted(BUILDERS)
# Family-independent code paths (the loader's layouts, dtypes, files) run on one family.
REFERENCE_FAMILY = "qwen2_vl" if "qwen2_vl" in FAMILIES else FAMILIES[0]
# Relative logits error (‖q − f‖ / ‖f‖) a correct quantization stays under; see above.
TOLERANCE = {8: 0.08, 4: 0.7}
MESSAGES = [{"role": "user", "content": [
    {"type": "image"}, {"type": "text", "text": "Describe this image."},
]}]
IMAGE = make_image(112, 84, seed=1)


# --------------------------------------------------------------------------------- helpers


def source_path(tiny_checkpoints, family: str) -> Path:
    return tiny_checkpoints.path(family, builder(family).LAYOUTS[0])


@pytest.fixture(scope="module")
def converted(tiny_checkpoints, tmp_path_factory):
    """(family, flags...) -> the output directory, each conversion done once."""
    root = tmp_path_factory.mktemp("converted")

    @functools.cache
    def run(family: str, **flags) -> Path:
        out = root / f"{family}-{len(list(root.iterdir()))}"
        source = flags.pop("source", None) or source_path(tiny_checkpoints, family)
        return convert(str(source), out, **flags).path

    return lambda family, **flags: run(family, **flags)


def load_as_stored(path: Path):
    """``load`` keeping every layer as stored: quantized layers (on the CPU backend its
    fast paths would dequantize them to float32 layers) and embedding tables a family
    gathers from disk (Gemma's per-layer table) among the model's modules."""
    return load(path, cpu_fast_paths=False, tables_on_disk=False)


@pytest.fixture(scope="module")
def loaded():
    """path -> (model, processor, first-pass logits on an image prompt), loaded once."""

    @functools.cache
    def run(path: Path):
        model, processor = load_as_stored(path)
        return model, processor, logits_of(model, processor)

    return run


def logits_of(model, processor) -> np.ndarray:
    inputs = prepare_inputs(processor, MESSAGES, [IMAGE], feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    return np.array(logits[0].astype(mx.float32))


def relative_error(logits: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(logits - reference) / np.linalg.norm(reference))


def is_quantized(module) -> bool:
    return hasattr(module, "scales") and hasattr(module, "bits")


def quantizable_modules(model) -> dict[str, nn.Module]:
    """Modules a quantization replaces or has replaced (linear, embedding, switch layers)."""
    return {
        path: module for path, module in model.named_modules()
        if hasattr(module, "to_quantized") or is_quantized(module)
    }


def input_size(module) -> int:
    """The dimension quantization groups run along."""
    if is_quantized(module):
        return module.scales.shape[-1] * module.group_size
    return module.weight.shape[-1]


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def weight_bytes(path: Path) -> int:
    """The tensors' bytes in the safetensors files, their headers (names, shapes) left out:
    the header grows with each quantized module's two extra tensors, by its name's length."""
    total = 0
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as handle:
            header = int.from_bytes(handle.read(8), "little")
        total += f.stat().st_size - 8 - header
    return total


def tensors(path: Path) -> dict[str, mx.array]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(file)))
    return out


# ----------------------------------------------------------------------- uniform round trip


@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_round_trip(family, bits, group_size, tiny_checkpoints, converted, loaded):
    source = source_path(tiny_checkpoints, family)
    path = converted(family, quantize=True, q_bits=bits, q_group_size=group_size)
    config = config_of(path)
    expected = {"group_size": group_size, "bits": bits, "mode": "affine"}
    assert config["quantization"] == expected
    assert config["quantization_config"] == expected
    assert config[CONVERTED_MARKER]
    assert "vision_config" in config or "vision_config" not in config_of(source)

    model, _, logits = loaded(path)
    modules = quantizable_modules(model)
    quantized = {p for p, m in modules.items() if is_quantized(m)}
    # Exactly the text modules whose input size divides by the group size (the tiny
    # models' odd widths leave some float); towers and projectors stay float.
    assert quantized, "nothing was quantized"
    assert quantized == {p for p, m in modules.items()
                         if not is_multimodal_path(p) and input_size(m) % group_size == 0}
    for p in quantized:
        m = modules[p]
        assert (m.bits, m.group_size, m.mode) == (bits, group_size, "affine"), p

    _, _, reference = loaded(source)
    error = relative_error(logits, reference)
    assert 0 < error < TOLERANCE[bits], f"{bits}-bit logits error {error:.3f}"


@pytest.mark.parametrize("family", FAMILIES)
def test_size_on_disk_matches_the_bits(family, tiny_checkpoints, converted):
    """Every quantized weight takes bits + 2·32/group_size bits (float32 scales and
    biases), and the files shrink by exactly what the quantized modules saved."""
    plain = converted(family)
    for bits, group_size in [(4, 32), (4, 64), (8, 64)]:
        path = converted(family, quantize=True, q_bits=bits, q_group_size=group_size)
        stored = tensors(path)
        float_tensors = tensors(plain)
        saved = 0
        prefixes = {k[: -len(".scales")] for k in stored if k.endswith(".scales")}
        assert prefixes
        for prefix in prefixes:
            weight = float_tensors[f"{prefix}.weight"]
            packed = sum(stored[f"{prefix}.{n}"].nbytes for n in ("weight", "scales", "biases"))
            assert packed * 8 / weight.size == bits + 64 / group_size, prefix
            saved += weight.nbytes - packed
        # safetensors headers differ by a few hundred bytes per tensor name
        shrink = weight_bytes(plain) - weight_bytes(path)
        assert abs(shrink - saved) < 100 * len(prefixes) + 4096, (shrink, saved)


@pytest.mark.parametrize("family", FAMILIES)
def test_tolerance_catches_broken_quantization(family, tiny_checkpoints, converted, loaded, tmp_path):
    """Scales moved to the wrong groups (as a broken quantizer would) push the error far
    above the 4-bit tolerance, and 8 bits is clearly better than 4."""
    path = converted(family, quantize=True, q_bits=4, q_group_size=32)
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    weights = tensors(path)
    for name in [k for k in weights if k.endswith(".scales") and not is_multimodal_path(k)]:
        weights[name] = mx.roll(weights[name], 1, axis=0)
    for file in broken.glob("*.safetensors"):
        file.unlink()
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    (broken / "model.safetensors.index.json").unlink()

    _, _, reference = loaded(source_path(tiny_checkpoints, family))
    _, _, broken_logits = loaded(broken)
    assert relative_error(broken_logits, reference) > 1.2 * TOLERANCE[4]
    _, _, logits4 = loaded(path)
    _, _, logits8 = loaded(converted(family, quantize=True, q_bits=8, q_group_size=32))
    assert relative_error(logits8, reference) < relative_error(logits4, reference) / 4


@pytest.mark.parametrize("family", FAMILIES)
def test_dequantize_round_trip(family, tiny_checkpoints, converted, loaded):
    quantized = converted(family, quantize=True, q_bits=4, q_group_size=64)
    path = converted(family, source=quantized, dequantize=True)
    config = config_of(path)
    assert "quantization" not in config and "quantization_config" not in config
    assert config[CONVERTED_MARKER]
    model, _, logits = loaded(path)
    assert not any(is_quantized(m) for m in quantizable_modules(model).values())
    # The same float32 weights the 4-bit model computes with, unpacked.
    _, _, quantized_logits = loaded(quantized)
    np.testing.assert_allclose(logits, quantized_logits, rtol=1e-4, atol=1e-4)
    plain = converted(family)
    assert abs(weight_bytes(path) - weight_bytes(plain)) < 0.01 * weight_bytes(plain)


@pytest.mark.parametrize("family", [REFERENCE_FAMILY])
def test_bfloat16_quantized_loads_in_float32_on_cpu(family, tiny_checkpoints, converted, loaded):
    """mlx-community's usual checkpoints: bfloat16 scales (4.5 bits a weight at group
    size 64); the CPU loader computes in float32, scales included."""
    path = converted(family, quantize=True, dtype="bfloat16")
    stored = tensors(path)
    scales = [v for k, v in stored.items() if k.endswith(".scales")]
    assert scales and all(s.dtype == mx.bfloat16 for s in scales)
    assert config_of(path).get("torch_dtype", "bfloat16") == "bfloat16"
    model, _, logits = loaded(path)
    quantized = [m for m in quantizable_modules(model).values() if is_quantized(m)]
    if mx.default_device() == mx.cpu:
        assert quantized and all(m.scales.dtype == mx.float32 for m in quantized)
    _, _, reference = loaded(source_path(tiny_checkpoints, family))
    assert relative_error(logits, reference) < TOLERANCE[4]
    # What a user gets by default: on the CPU the layers are dequantized once at load.
    default_model, processor = load(path)
    np.testing.assert_allclose(logits_of(default_model, processor), logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode, bits, group_size", [
    ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)])
def test_floating_point_modes(mode, bits, group_size, tiny_checkpoints, converted, loaded):
    """The microscaling modes: fixed bits and group size, uint8 scales, no biases. Their
    coarse scales (powers of two for mx*) make even mxfp8 about as lossy here as 4-bit
    affine."""
    family = REFERENCE_FAMILY
    path = converted(family, quantize=True, q_mode=mode)
    assert config_of(path)["quantization"] == {"group_size": group_size, "bits": bits, "mode": mode}
    model, _, logits = loaded(path)
    quantized = [m for m in quantizable_modules(model).values() if is_quantized(m)]
    assert quantized and all((m.mode, m.bits, m.group_size) == (mode, bits, group_size)
                             for m in quantized)
    _, _, reference = loaded(source_path(tiny_checkpoints, family))
    assert 0 < relative_error(logits, reference) < TOLERANCE[4]


# ------------------------------------------------------------------------ marker, sanitize


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_checkpoint_loads_without_sanitize(family, tiny_checkpoints, converted, loaded,
                                                     monkeypatch, tmp_path):
    """Marked in config.json by us; in the safetensors metadata by every MLX tool (so an
    unmarked float checkpoint whose names are the Hub's, as mlx-vlm writes some families,
    is not sanitized twice)."""
    source = source_path(tiny_checkpoints, family)
    plain = converted(family)
    paths = [plain, converted(family, quantize=True, q_bits=4, q_group_size=64)]
    unmarked = tmp_path / "unmarked"
    shutil.copytree(plain, unmarked)
    config = config_of(unmarked)
    del config[CONVERTED_MARKER]
    (unmarked / "config.json").write_text(json.dumps(config))
    _, _, reference = loaded(source)

    def refuse(self, weights):
        raise AssertionError("sanitize ran on a converted checkpoint")

    monkeypatch.setattr(get_family(config["model_type"]).Model, "sanitize", refuse)
    for path in paths:
        assert config_of(path)[CONVERTED_MARKER]
        load_as_stored(path)
    model, processor = load_as_stored(unmarked)
    np.testing.assert_allclose(logits_of(model, processor), reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="sanitize ran"):  # the patch is effective
        load_as_stored(source)


# --------------------------------------------------------------------------- mixed recipe


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_4_8_recipe(family, tiny_checkpoints, converted, loaded):
    """Group size 32, where the tiny models' widths let most layers be quantized."""
    path = converted(family, quantize=True, quant_predicate="mixed_4_8", q_group_size=32)
    quantization = config_of(path)["quantization"]
    assert {k: quantization[k] for k in ("group_size", "bits", "mode")} == {
        "group_size": 32, "bits": 4, "mode": "affine"}
    assert config_of(path)["quantization_config"] == quantization
    overrides = {k: v for k, v in quantization.items() if isinstance(v, dict)}
    assert all(v == {"group_size": 32, "bits": 8, "mode": "affine"} for v in overrides.values())

    # The sensitive layers of the float model that can be quantized at all: embeddings,
    # the head, v_proj/down_proj of the first, last and every third decoder block.
    float_model, _, reference = loaded(source_path(tiny_checkpoints, family))
    num_blocks = len(float_model.layers)

    def sensitive(path: str, module) -> bool:
        leaf = path.rsplit(".", 1)[-1]
        parts = path.split(".")
        block = next((int(i) for n, i in zip(parts, parts[1:]) if n == "layers" and i.isdigit()), None)
        return (isinstance(module, nn.Embedding) or leaf == "lm_head" or (
            leaf in ("v_proj", "down_proj") and block is not None
            and sensitive_block(block, num_blocks)))

    expected = {p for p, m in quantizable_modules(float_model).items()
                if not is_multimodal_path(p) and input_size(m) % 32 == 0 and sensitive(p, m)}
    assert set(overrides) == expected
    assert sensitive_block(0, num_blocks) and sensitive_block(num_blocks - 1, num_blocks)

    # The loaded modules have exactly the bits the config lists.
    model, _, logits = loaded(path)
    bits = {p: m.bits for p, m in quantizable_modules(model).items() if is_quantized(m)}
    assert bits == {p: 8 if p in overrides else 4 for p in bits}
    assert 4 in bits.values()
    _, _, uniform4 = loaded(converted(family, quantize=True, q_bits=4, q_group_size=32))
    if overrides:
        assert relative_error(logits, reference) < relative_error(uniform4, reference)


def test_sensitive_blocks_follow_q4_k_m():
    """llama.cpp's choice for 28 blocks (first/last eighth, every third between), and
    always the first and the last block."""
    assert [i for i in range(28) if sensitive_block(i, 28)] == [
        0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert [i for i in range(2) if sensitive_block(i, 2)] == [0, 1]
    assert [i for i in range(6) if sensitive_block(i, 6)] == [0, 2, 5]


# ----------------------------------------------------------------- towers, --verbose, report


@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_vision_lists_the_modules_left_float(family, tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "vision"
    code = main(["--hf-path", str(source_path(tiny_checkpoints, family)), "--mlx-path", str(out),
                 "-q", "--q-group-size", "64", "--quantize-vision", "--verbose"])
    assert code == 0
    captured = capsys.readouterr()
    assert "bits per weight" in captured.out and "on disk" in captured.out
    model, _ = load_as_stored(out)
    modules = quantizable_modules(model)
    float_left = {p for p, m in modules.items() if not is_quantized(m)}
    assert float_left == {p for p, m in modules.items() if input_size(m) % 64}
    if float_left:
        listed = captured.err.split(": ", 1)[1].strip().split(", ")
        assert set(listed) == float_left
    else:
        assert captured.err == ""


# ------------------------------------------------------------------- layouts load() reads


@pytest.mark.parametrize("family", [REFERENCE_FAMILY])
def test_load_reads_every_quantization_layout(family, converted, loaded, tmp_path):
    """mlx-lm's layout as other tools write it: no ``mode`` (older configs), only
    ``quantization_config``, per-layer settings missing from the config (read from the
    shapes), layers marked ``false``, and no conversion marker (mlx-community's)."""
    mixed = converted(family, quantize=True, quant_predicate="mixed_4_8")
    _, _, mixed_logits = loaded(mixed)

    def variant(name: str, edit):
        path = tmp_path / name
        shutil.copytree(mixed, path)
        config = config_of(path)
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
        return load_as_stored(path)

    def no_mode(config):
        for q in (config["quantization"], config["quantization_config"]):
            q.pop("mode")
            for v in q.values():
                if isinstance(v, dict):
                    v.pop("mode")

    def only_mirror(config):
        config.pop("quantization")

    def no_overrides(config):
        for key in ("quantization", "quantization_config"):
            config[key] = {k: v for k, v in config[key].items() if not isinstance(v, dict)}

    def unmarked(config):
        config.pop(CONVERTED_MARKER)

    for name, edit in [("no_mode", no_mode), ("only_mirror", only_mirror),
                       ("no_overrides", no_overrides), ("unmarked", unmarked)]:
        model, processor = variant(name, edit)
        np.testing.assert_allclose(logits_of(model, processor), mixed_logits, rtol=1e-5,
                                   atol=1e-5, err_msg=name)

    # A layer marked false stays float; here its stored weights are float too.
    model, _, _ = loaded(mixed)
    target = next(p for p, m in quantizable_modules(model).items()
                  if is_quantized(m) and not isinstance(m, nn.QuantizedEmbedding))
    path = tmp_path / "marked_false"
    shutil.copytree(mixed, path)
    weights = tensors(path)
    module = dict(model.named_modules())[target]
    weights[f"{target}.weight"] = mx.dequantize(
        module.weight, module.scales, module.biases, module.group_size, module.bits)
    del weights[f"{target}.scales"], weights[f"{target}.biases"]
    for file in path.glob("*.safetensors"):
        file.unlink()
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "model.safetensors.index.json").unlink()
    config = config_of(path)
    config["quantization"][target] = False
    config["quantization_config"] = config["quantization"]
    (path / "config.json").write_text(json.dumps(config))
    model, processor = load_as_stored(path)
    assert not is_quantized(dict(model.named_modules())[target])
    np.testing.assert_allclose(logits_of(model, processor), mixed_logits, rtol=1e-4, atol=1e-4)


def test_read_quantization_ignores_hf_quantization_configs():
    assert read_quantization({"quantization_config": {"quant_method": "awq", "bits": 4}}) is None
    assert read_quantization({}) is None
    model = nn.Sequential(nn.Linear(64, 64))
    apply_quantization(model, {"quantization": {}}, {})
    assert isinstance(model.layers[0], nn.Linear)


# -------------------------------------------------------------------- sharding and files


@pytest.mark.parametrize("family", [REFERENCE_FAMILY])
def test_sharded_output_and_side_files(family, tiny_checkpoints, tmp_path, monkeypatch, loaded):
    import mlxvlm.convert as convert_module

    source = source_path(tiny_checkpoints, family)
    monkeypatch.setattr(convert_module, "MAX_SHARD_GB", 0)  # one tensor a shard
    path = convert(str(source), tmp_path / "sharded", quantize=True).path
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert set(index["weight_map"]) == set(tensors(path))
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors(path).values())
    # Tokenizer, processor and chat template files travel with the weights.
    for file in source.iterdir():
        if file.suffix in (".json", ".jinja", ".txt") and file.name not in (
                "config.json", "model.safetensors.index.json"):
            assert (path / file.name).read_bytes() == file.read_bytes(), file.name
    card = (path / "README.md").read_text()
    assert "library_name: mlx" in card and "pipeline_tag: image-text-to-text" in card
    assert f'mlxvlm.load("{path.name}")' in card
    _, _, sharded_logits = loaded(path)
    _, _, whole_logits = loaded(convert(str(source), tmp_path / "whole", quantize=True).path)
    np.testing.assert_array_equal(sharded_logits, whole_logits)


def test_model_card_names_the_base_model(tmp_path):
    write_model_card(tmp_path, name="me/Qwen2-VL-2B-Instruct-4bit",
                     base_model="Qwen/Qwen2-VL-2B-Instruct", source=tmp_path,
                     precision="4-bit affine quantization, group size 64")
    card = (tmp_path / "README.md").read_text()
    assert "base_model: Qwen/Qwen2-VL-2B-Instruct" in card
    assert "--model me/Qwen2-VL-2B-Instruct-4bit" in card
    assert "library_name: mlx" in card and "pipeline_tag: image-text-to-text" in card


# ---------------------------------------------------------------------------------- upload


class FakeHub:
    calls: list = []
    fail = False

    def create_repo(self, **kwargs):
        FakeHub.calls.append(("create_repo", kwargs))

    def upload_large_folder(self, **kwargs):
        if FakeHub.fail:
            raise ConnectionError("no network")
        FakeHub.calls.append(("upload_large_folder", kwargs))


def test_upload_uses_the_hub_client(tiny_checkpoints, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    FakeHub.calls = []
    source = source_path(tiny_checkpoints, REFERENCE_FAMILY)
    path = convert(str(source), tmp_path / "up", upload_repo="me/tiny-vlm").path
    (_, create), (_, upload) = FakeHub.calls
    assert create["repo_id"] == "me/tiny-vlm" and create["exist_ok"]
    assert upload["repo_id"] == "me/tiny-vlm" and Path(upload["folder_path"]) == path
    assert 'mlxvlm.load("me/tiny-vlm")' in (path / "README.md").read_text()

    FakeHub.fail = True
    try:
        with pytest.raises(MlxvlmError, match="uploading to me/tiny-vlm failed.*converted model is in"):
            convert(str(source), tmp_path / "up2", upload_repo="me/tiny-vlm")
    finally:
        FakeHub.fail = False
    assert (tmp_path / "up2" / "config.json").exists()  # the work is kept


# ---------------------------------------------------------------------------------- errors


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("flags, message", [
    (["-q", "--q-mode", "int3"], "unknown quantization mode 'int3'"),
    (["-q", "--q-group-size", "48"], "group size 48 is not possible"),
    (["-q", "--q-mode", "mxfp4", "--q-group-size", "64"], "mxfp4 quantization needs group size 32"),
    (["-q", "--q-bits", "7"], "affine quantization takes"),
    (["-q", "--quant-predicate", "mixed_9_9"], "unknown quantization recipe"),
    (["--q-bits", "4"], "--q-bits only apply with -q"),
    (["-q", "-d"], "either -q/--quantize or -d/--dequantize"),
    (["--dtype", "float64"], "unknown --dtype"),
    (["-q", "--q-bits", "four"], "invalid int value"),
])
def test_bad_options_are_one_line_errors(flags, message, tmp_path, capsys):
    code = main(["--hf-path", str(tmp_path / "nowhere"), "--mlx-path", str(tmp_path / "out"), *flags])
    assert code == 2
    assert message in _error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_destination_needs_force(tiny_checkpoints, tmp_path, capsys):
    source = str(source_path(tiny_checkpoints, REFERENCE_FAMILY))
    out = tmp_path / "out"
    assert main(["--hf-path", source, "--mlx-path", str(out)]) == 0
    capsys.readouterr()
    assert main(["--hf-path", source, "--mlx-path", str(out), "-q"]) == 2
    assert "already exists" in _error_line(capsys)
    assert "quantization" not in config_of(out)
    assert main(["--hf-path", source, "--mlx-path", str(out), "-q", "--force"]) == 0
    assert config_of(out)["quantization"]["bits"] == 4
    # --force replaces conversions, not arbitrary directories
    other = tmp_path / "documents"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert main(["--hf-path", source, "--mlx-path", str(other), "--force"]) == 2
    assert "not a model checkpoint" in _error_line(capsys)
    assert (other / "notes.txt").exists()


def test_failed_conversion_leaves_no_output(tiny_checkpoints, tmp_path, monkeypatch):
    import mlxvlm.convert as convert_module

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(convert_module, "write_model_card", fail)
    with pytest.raises(OSError, match="disk full"):
        convert(str(source_path(tiny_checkpoints, REFERENCE_FAMILY)), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_sources_that_are_not_supported_vlms(tiny_checkpoints, tmp_path, capsys):
    llm = tmp_path / "llama"
    llm.mkdir()
    (llm / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["--hf-path", str(llm), "--mlx-path", str(tmp_path / "a")]) == 2
    assert "is not a vision-language model mlxvlm supports" in _error_line(capsys)

    assert main(["--hf-path", str(tmp_path / "missing"), "--mlx-path", str(tmp_path / "b")]) == 2
    assert "does not exist" in _error_line(capsys)

    source = str(source_path(tiny_checkpoints, REFERENCE_FAMILY))
    assert main(["--hf-path", source, "--mlx-path", str(tmp_path / "c"), "-d"]) == 2
    assert "not quantized" in _error_line(capsys)
    assert main(["--hf-path", source, "--mlx-path", source, "--force"]) == 2
    assert "would overwrite the source" in _error_line(capsys)


# runpy warns that the package already imported the module it runs; harmless here.
@pytest.mark.filterwarnings("ignore:'mlxvlm.convert' found in sys.modules:RuntimeWarning")
def test_module_entry_point_exit_code(tmp_path, monkeypatch, capsys):
    """`python -m mlxvlm.convert` exits with main's code."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["mlxvlm.convert", "--hf-path", str(tmp_path),
                                      "--mlx-path", str(tmp_path / "out"), "-q", "--q-mode", "int3"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("mlxvlm.convert", run_name="__main__")
    assert exit_.value.code == 2
    assert _error_line(capsys).startswith("error: unknown quantization mode")


# ------------------------------------------------------------- mlx-vlm's own conversions


def _mlx_vlm_python() -> str | None:
    """An interpreter with mlx-vlm: $MLXVLM_TEST_MLX_VLM_PYTHON, or this one if it has it."""
    configured = os.environ.get("MLXVLM_TEST_MLX_VLM_PYTHON")
    if configured:
        return configured
    return sys.executable if importlib.util.find_spec("mlx_vlm") else None


@pytest.mark.skipif(_mlx_vlm_python() is None, reason="mlx-vlm is not installed "
                    "(set MLXVLM_TEST_MLX_VLM_PYTHON to a Python that has it)")
@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_vlm_conversions_load_unchanged(family, tiny_checkpoints, converted, loaded, tmp_path):
    """What mlx-community publishes: mlx-vlm's convert (bfloat16, and 4-bit at group size
    32) of the same checkpoint loads unchanged and computes what ours computes. Both write
    the same module names and the same tensors; mlx-vlm's choice of modules to quantize
    differs for some families (e.g. it quantizes Idefics3's connector), so at 4 bits the
    modules quantized by only one side are checked through the logits."""
    python = _mlx_vlm_python()
    _, _, reference = loaded(source_path(tiny_checkpoints, family))
    done = False
    for layout in builder(family).LAYOUTS:
        source = tiny_checkpoints.path(family, layout)
        for name, flags, ours in [
            ("bf16", ["--dtype", "bfloat16"], dict(dtype="bfloat16")),
            ("q4", ["-q", "--q-bits", "4", "--q-group-size", "32"],
             dict(quantize=True, q_bits=4, q_group_size=32)),
        ]:
            out = tmp_path / f"{layout}-{name}"
            run = subprocess.run([python, "-m", "mlx_vlm.convert", "--hf-path", str(source),
                                  "--mlx-path", str(out), *flags], capture_output=True, text=True)
            if run.returncode != 0:  # mlx-vlm cannot convert this tiny checkpoint
                continue
            # mlx-vlm 0.7 adds a processor_config.json made from the processor classes'
            # defaults (Gemma 4's 16-pixel patches for the tiny one's 8, LLaVA's and
            # LFM2-VL's image token counts), which transformers then prefers to the
            # checkpoint's own files; a real checkpoint's values are those defaults. The
            # weights and config are what is compared here.
            if not (source / "processor_config.json").exists():
                (out / "processor_config.json").unlink(missing_ok=True)
            done = True
            mine = converted(family, source=source, **ours)
            theirs, my_tensors = tensors(out), tensors(mine)
            # a part the family may go without (MiniCPM-V 4.6's and Qwen3.5's MTP head)
            # that mlx-vlm's convert drops, as mlx-lm's does: its conversion loads
            # without it, and the rest must still be ours
            for part in loaded(mine)[0].optional_parts:
                if not any(k.startswith(f"{part}.") for k in theirs):
                    my_tensors = {k: v for k, v in my_tensors.items()
                                  if not k.startswith(f"{part}.")}

            def modules(names):
                return {n.rsplit(".", 1)[0] for n in names}

            assert modules(theirs) == modules(my_tensors)
            quantized_by_one = modules(k for k in set(theirs) ^ set(my_tensors))
            for key in set(theirs) & set(my_tensors):
                if key.rsplit(".", 1)[0] in quantized_by_one:
                    continue
                assert theirs[key].dtype == my_tensors[key].dtype, key
                assert mx.array_equal(theirs[key], my_tensors[key]).item(), key
            _, _, their_logits = loaded(out)
            _, _, my_logits = loaded(mine)
            if name == "bf16":
                assert set(theirs) == set(my_tensors)
                np.testing.assert_allclose(their_logits, my_logits, rtol=1e-5, atol=1e-5)
            else:
                assert relative_error(their_logits, reference) < TOLERANCE[4]
    if not done:
        pytest.skip(f"mlx-vlm could not convert any layout of the tiny {family} checkpoint")
