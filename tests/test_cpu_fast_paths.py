"""The CPU backend's fast paths give the standard MLX path's results, and can be turned off.

- quantized layers on mlxvlm's quantized CPU kernel (packed weights), or, without the
  kernels, dequantized to float32 at load, or kept quantized and dequantized per
  multi-row product (when float32 would not fit the memory budget), against MLX's own
  quantized kernels;
- the system OpenBLAS preloaded before mlx.core, or not (MLXVLM_NO_OPENBLAS=1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from parity import first_logits_and_greedy_tokens
from tiny import make_image
from mlxvlm import load
from mlxvlm.cpu import policy
from mlxvlm.cpu.fast_paths import CPUQuantizedLinear
from mlxvlm.cpu.quantized import CPUKernelQuantizedLinear
from mlxvlm.checkpoint.loading import CONVERTED_MARKER

IMAGE = make_image(112, 84, seed=1)
PROMPT = "Describe this image."


@pytest.fixture(scope="module")
def quantized_checkpoint(tiny_checkpoints, tmp_path_factory):
    """The tiny Qwen2-VL with its text decoder in 4-bit (group size 32), in MLX layout."""
    source = tiny_checkpoints.path("qwen2_vl", "hub")
    model, _ = load(source, cpu_fast_paths=False)
    nn.quantize(model.language_model, group_size=32, bits=4)
    target = tmp_path_factory.mktemp("quantized") / "qwen2_vl-4bit"
    shutil.copytree(source, target)
    for f in target.glob("*.safetensors"):
        f.unlink()
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((target / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    config[CONVERTED_MARKER] = "mlx"
    (target / "config.json").write_text(json.dumps(config))
    return target


def logits_and_tokens(model, processor):
    return first_logits_and_greedy_tokens(model, processor, PROMPT, IMAGE, max_tokens=24)


def quantized_types(model):
    return {type(m) for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}


@pytest.fixture(scope="module")
def standard(quantized_checkpoint):
    model, processor = load(quantized_checkpoint, cpu_fast_paths=False)
    assert quantized_types(model) == {nn.QuantizedLinear}
    return logits_and_tokens(model, processor)


def test_quantized_kernel_matches_mlx_quantized_kernels(quantized_checkpoint, standard):
    model, processor = load(quantized_checkpoint)
    assert quantized_types(model) == {CPUKernelQuantizedLinear}
    report = model.cpu_fast_paths
    assert report.kernel_quantized > 0 and report.dequantized == 0
    assert "packed weights" in report.describe()
    logits, tokens = logits_and_tokens(model, processor)
    np.testing.assert_allclose(logits, standard[0], atol=1e-4, rtol=0)
    assert tokens == standard[1]


def test_dequantized_at_load_matches_quantized_kernels(quantized_checkpoint, standard,
                                                       monkeypatch):
    monkeypatch.setenv(policy.NO_KERNELS_ENV, "1")  # the path without the CPU kernels
    model, processor = load(quantized_checkpoint)
    assert quantized_types(model) == set()
    assert model.cpu_fast_paths.dequantized > 0
    logits, tokens = logits_and_tokens(model, processor)
    np.testing.assert_allclose(logits, standard[0], atol=1e-4, rtol=0)
    assert tokens == standard[1]


def test_kept_quantized_over_budget_matches_quantized_kernels(quantized_checkpoint, standard, monkeypatch):
    monkeypatch.setenv(policy.NO_KERNELS_ENV, "1")
    monkeypatch.setenv(policy.DEQUANTIZE_BUDGET_ENV, "0")
    model, processor = load(quantized_checkpoint)
    assert quantized_types(model) == {CPUQuantizedLinear}
    assert model.cpu_fast_paths.streamed > 0
    logits, tokens = logits_and_tokens(model, processor)
    np.testing.assert_allclose(logits, standard[0], atol=1e-4, rtol=0)
    assert tokens == standard[1]


def test_opt_out_keeps_mlx_quantized_kernels(quantized_checkpoint, monkeypatch):
    monkeypatch.setenv(policy.NO_FAST_PATHS_ENV, "1")
    model, _ = load(quantized_checkpoint)
    assert quantized_types(model) == {nn.QuantizedLinear}
    assert "off" in model.cpu_fast_paths.describe()


def test_quantized_model_really_differs_from_float(tiny_checkpoints, standard):
    """Guards the comparison above: the checkpoint is really quantized."""
    model, processor = load(tiny_checkpoints.path("qwen2_vl", "hub"))
    logits, _ = logits_and_tokens(model, processor)
    assert np.abs(logits - standard[0]).max() > 1e-3


OPENBLAS_PROBE = """
import numpy as np
import mlxvlm
from mlxvlm.cpu import blas
import mlx.core as mx
a = np.random.default_rng(0).normal(size=(96, 80)).astype(np.float32)
b = np.random.default_rng(1).normal(size=(80, 72)).astype(np.float32)
err = float(np.abs(np.array(mx.array(a) @ mx.array(b)) - a @ b).max())
print(blas.openblas_status, "|", err)
"""


def probe(script, env_extra):
    """What a fresh interpreter running ``script`` prints, as "status | value" parts."""
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return [part.strip() for part in out.stdout.split("|")]


def run_probe(env_extra):
    status, err = probe(OPENBLAS_PROBE, env_extra)
    return status, float(err)


@pytest.mark.skipif(sys.platform != "linux", reason="the OpenBLAS preload is for Linux")
def test_openblas_preload_and_opt_out():
    status, err = run_probe({"MLXVLM_NO_OPENBLAS": ""})
    assert status.startswith("loaded"), status
    assert err < 1e-3
    status, err = run_probe({"MLXVLM_NO_OPENBLAS": "1"})
    assert status == "disabled by MLXVLM_NO_OPENBLAS"
    assert err < 1e-3


FAULTS_PROBE = """
import resource
import mlxvlm
from mlxvlm.cpu import malloc
import mlx.core as mx
mx.set_cache_limit(0)  # every freed buffer goes back to malloc: what is measured here
x = mx.random.normal((1024, 3072))  # 12 MB
mx.eval(x)
def faults_of_a_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        parts = [x * float(i) for i in range(4)]  # 48 MB alive at once, then freed
        mx.eval(parts)
        del parts
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_round()
print(malloc.malloc_status, "|", ",".join(str(faults_of_a_round()) for _ in range(3)))
"""


def page_faults_of_reused_activations(env_extra):
    """malloc's status and the page faults of three warm rounds."""
    status, faults = probe(FAULTS_PROBE, env_extra)
    return status, [int(f) for f in faults.split(",")]


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc thresholds")
def test_freed_activations_are_reused_not_faulted_in_again():
    """Arrays of a few MB freed and allocated again (a tower's activations, layer after
    layer) come back from malloc's arenas: no page faults once warm. Without the tuning
    glibc returns them to the kernel and every 4 KB page faults in again."""
    # Three warm rounds each way, compared at their best and worst: a single round
    # was seen to fault one 12 MB block in (3,072 pages) tuned, and only that untuned,
    # on a host busy with other work.
    status, faults = page_faults_of_reused_activations({"MLXVLM_NO_MALLOC_TUNING": ""})
    assert status.startswith("blocks under 32 MB reused"), status
    assert min(faults) < 1000, faults
    status, faults = page_faults_of_reused_activations({"MLXVLM_NO_MALLOC_TUNING": "1"})
    assert status == "disabled by MLXVLM_NO_MALLOC_TUNING"
    assert max(faults) > 5000, faults  # 12 blocks of 12 MB a round: ~3,000 pages each
