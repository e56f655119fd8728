"""`mlxvlm.fuse`: an adapter merged into its base gives the logits of base + adapter, for
LoRA and DoRA, on a float base and on a quantized one (QLoRA: re-quantized, or -d), and
with -q; the CLI's errors are one line."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.nn as nn
import numpy as np
import pytest

from finetune_helpers import small_dataset
from tiny import make_image
from user_environment import user_environment
from mlxvlm import load
from mlxvlm.convert import convert
from mlxvlm.finetune import FinetuneConfig, finetune
from mlxvlm.fuse import fuse
from mlxvlm.prompt import prepare_inputs

FAMILY = "qwen2_vl"
IMAGE = make_image(84, 56, seed=5)
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]


def logits(model, processor) -> np.ndarray:
    inputs = prepare_inputs(processor, MESSAGES, [IMAGE], feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    return np.array(model(inputs.input_ids, embeddings=embeddings, state=state)[0])


def quantized_layers(model) -> int:
    return sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())


@pytest.fixture(scope="module")
def quantized_base(tiny_checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "q8"
    convert(str(tiny_checkpoints.path(FAMILY, "hub")), path, quantize=True, q_bits=8, q_group_size=32)
    return path


def train(base, tmp_path, method="lora", name="adapter"):
    return finetune(FinetuneConfig(
        model=str(base), data=str(small_dataset(tmp_path / "data", count=4)),
        output=str(tmp_path / name), method=method, rank=4, alpha=8, batch_size=2, iters=3,
        learning_rate=1e-2,
    )).output


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_fused_float_model_matches_base_plus_adapter(tiny_checkpoints, tmp_path, method):
    base = tiny_checkpoints.path(FAMILY, "hub")
    adapter = train(base, tmp_path, method)
    adapted, processor = load(base, adapter_path=adapter)
    expected = logits(adapted, processor)
    assert np.abs(expected - logits(load(base)[0], processor)).max() > 1e-2

    result = fuse(str(base), adapter, tmp_path / "fused")
    assert result.fused_layers == 14
    fused, processor = load(tmp_path / "fused")
    assert not any("lora" in name for name, _ in fused.named_modules())
    np.testing.assert_allclose(logits(fused, processor), expected, atol=1e-4, rtol=1e-4)


def test_qlora_trains_on_a_quantized_base_and_fuses(quantized_base, tmp_path):
    result = finetune(FinetuneConfig(
        model=str(quantized_base), data=str(small_dataset(tmp_path / "data", count=4)),
        output=str(tmp_path / "adapter"), rank=4, alpha=8, batch_size=2, iters=3,
        learning_rate=1e-2,
    ))
    assert result.tuning.quantized_bases == 14  # trained over the quantized weights
    assert np.isfinite(result.train_loss)
    adapter = result.output
    # MLX's own quantized kernels (no CPU fast path): the base stays quantized.
    adapted, processor = load(quantized_base, adapter_path=adapter, cpu_fast_paths=False)
    assert quantized_layers(adapted) > 0
    expected = logits(adapted, processor)

    base = logits(load(quantized_base, cpu_fast_paths=False)[0], processor)

    # Default: the fused layers are quantized again with the base's settings. That
    # rounding moves the logits a little; the adapter's effect is much larger.
    requantized, _ = load(fuse(str(quantized_base), adapter, tmp_path / "q").converted.path,
                          cpu_fast_paths=False)
    assert quantized_layers(requantized) == quantized_layers(load(quantized_base, cpu_fast_paths=False)[0])
    rounding = np.abs(logits(requantized, processor) - expected).max()
    assert rounding < 0.2 * np.abs(expected - base).max()

    # -d: a float model holding exactly dequantized base + update.
    dequantized, _ = load(fuse(str(quantized_base), adapter, tmp_path / "d", dequantize=True).converted.path)
    assert quantized_layers(dequantized) == 0
    np.testing.assert_allclose(logits(dequantized, processor), expected, atol=1e-4, rtol=1e-4)


def test_fuse_and_quantize(tiny_checkpoints, tmp_path):
    base = tiny_checkpoints.path(FAMILY, "hub")
    adapter = train(base, tmp_path)
    result = fuse(str(base), adapter, tmp_path / "q8", quantize=True, q_bits=8, q_group_size=32)
    assert result.converted.quantization["bits"] == 8
    model, processor = load(tmp_path / "q8", cpu_fast_paths=False)
    assert quantized_layers(model) > 0
    adapted, _ = load(base, adapter_path=adapter)
    expected = logits(adapted, processor)
    # 8-bit rounding moves the logits a little; the fused update moved them much more.
    rounding = np.abs(logits(model, processor) - expected).max()
    assert rounding < 0.2 * np.abs(expected - logits(load(base)[0], processor)).max()


def test_cli(tiny_checkpoints, tmp_path):
    base = tiny_checkpoints.path(FAMILY, "hub")
    adapter = train(base, tmp_path)
    command = [sys.executable, "-m", "mlxvlm.fuse", "--model", str(base)]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(command + list(args), capture_output=True, text=True,
                              timeout=300, env=user_environment())

    # The missing adapter's run, independent of the others, alongside the first.
    with ThreadPoolExecutor(1) as alongside:
        missing_run = alongside.submit(run, "--adapter-path", str(tmp_path / "nope"),
                                       "--mlx-path", str(tmp_path / "x"))
        done = run("--adapter-path", str(adapter), "--mlx-path", str(tmp_path / "out"))
        missing = missing_run.result()
    assert done.returncode == 0, done.stderr
    assert "Fused 14 adapted layers" in done.stdout
    assert (tmp_path / "out" / "config.json").exists()

    again = run("--adapter-path", str(adapter), "--mlx-path", str(tmp_path / "out"))
    for failed, words in ((again, "already exists"), (missing, "does not exist")):
        assert failed.returncode == 2
        lines = failed.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0]
