"""`python -m mlxvlm.generate` end to end in a subprocess, including its error exits."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from tiny import make_image

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="session")
def torch_free_site(tmp_path_factory):
    """A sitecustomize that hides torch, as on a user's install (torch is test-only):
    transformers then does not import it, which keeps each CLI process fast."""
    site = tmp_path_factory.mktemp("torch-free-site")
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    return site


@pytest.fixture(autouse=True)
def _cli_environment(torch_free_site, monkeypatch):
    path = os.pathsep.join(p for p in (str(torch_free_site), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)


def run_cli(*args, env_extra=None, stdin=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "mlxvlm.generate", *map(str, args)],
        capture_output=True, text=True, env=env, input=stdin, timeout=300,
    )


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints.path("qwen2_vl", "hub")


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "picture.png"
    make_image(112, 84, seed=1).save(path)
    return path


def expected_text(checkpoint, image_file, max_tokens, **options):
    from mlxvlm import generate, load

    model, processor = load(checkpoint)
    return generate(
        model, processor, "Describe this image.", str(image_file), max_tokens=max_tokens, **options
    ).text


def test_generate_streams_the_same_text_as_the_api(checkpoint, image_file):
    result = run_cli(
        "--model", checkpoint, "--image", image_file, "--prompt", "Describe this image.",
        "--max-tokens", 12, "--verbose",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected_text(checkpoint, image_file, 12) + "\n"
    assert "prompt:" in result.stderr and "tokens/s" in result.stderr
    assert "peak memory" in result.stderr and "OpenBLAS" in result.stderr
    # The CPU set-up is reported: the sgemv shim's state, the maths fast paths and the
    # CPU kernels (built here: the test machine has the toolchain).
    assert "float32 products:" in result.stderr
    assert "malloc:" in result.stderr
    assert "CPU fast paths:" in result.stderr and "vectorised exp" in result.stderr
    assert "CPU kernels: attention, activation, norm" in result.stderr


def test_image_as_data_url_and_sampling_flags(checkpoint, image_file):
    data_url = "data:image/png;base64," + base64.b64encode(image_file.read_bytes()).decode()
    args = ["--model", checkpoint, "--image", data_url, "--prompt", "Describe this image.",
            "--max-tokens", 8, "--temp", "1.0", "--top-p", "0.9", "--top-k", "50",
            "--seed", "3", "--prefill-step-size", "7", "--repetition-penalty", "1.1"]
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.strip()


def test_prompt_from_stdin(checkpoint, image_file):
    result = run_cli("--model", checkpoint, "--image", image_file, "--prompt", "-",
                     "--max-tokens", 6, stdin="Describe this image.")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected_text(checkpoint, image_file, 6) + "\n"


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_image_file(checkpoint, tmp_path):
    missing = tmp_path / "nope.jpg"
    result = run_cli("--model", checkpoint, "--image", missing, "--prompt", "Hi")
    assert_one_line_error(result, "nope.jpg")


def test_unreadable_image(checkpoint, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    result = run_cli("--model", checkpoint, "--image", broken, "--prompt", "Hi")
    assert_one_line_error(result, "broken.png")


def test_media_errors_name_no_option_the_cli_lacks(checkpoint, tmp_path):
    """The generate command has no media size options: an image over the limit is told
    to be smaller, not to raise a Python argument (read before the model is loaded)."""
    oversized = tmp_path / "oversized.png"
    with open(oversized, "wb") as file:
        file.truncate(51 * 2**20)  # sparse: the size is refused from fstat
    result = run_cli("--model", checkpoint, "--image", oversized, "--prompt", "Hi")
    assert_one_line_error(result, "oversized.png", "larger than the limit of 50.0 MB")
    assert result.stderr.rstrip().endswith("; use a smaller file"), result.stderr


def test_unknown_model_type(checkpoint, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    config["model_type"] = "no_such_vlm"
    (copy / "config.json").write_text(json.dumps(config))
    result = run_cli("--model", copy, "--prompt", "Hi")
    assert_one_line_error(result, "no_such_vlm", "not supported")


def test_prompt_longer_than_the_context(checkpoint):
    result = run_cli("--model", checkpoint, "--prompt", "cat " * 600, "--max-tokens", 4)
    assert_one_line_error(result, "context is 1024 tokens")


def test_model_not_in_cache_while_offline(tmp_path):
    result = run_cli("--model", "someone/not-a-cached-model", "--prompt", "Hi",
                     env_extra={"HF_HOME": str(tmp_path)})
    assert_one_line_error(result, "someone/not-a-cached-model", "local Hugging Face cache")


def test_missing_local_directory(tmp_path):
    result = run_cli("--model", tmp_path / "missing" / "model", "--prompt", "Hi")
    assert_one_line_error(result, "does not exist")


def test_model_not_in_cache_names_both_a_directory_and_the_hub(tmp_path):
    result = run_cli("--model", "someone/not-a-cached-model", "--prompt", "Hi",
                     env_extra={"HF_HOME": str(tmp_path)})
    assert_one_line_error(result, "neither a local directory nor a Hub repo", "HF_HUB_OFFLINE=1")


def test_a_mistyped_relative_path_suggests_the_directory_beside_it(checkpoint, tmp_path):
    shutil.copytree(checkpoint, tmp_path / "examples" / "shapes-vlm")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(
        [sys.executable, "-m", "mlxvlm.generate", "--model", "examples/shapes-vml"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert_one_line_error(result, "'examples/shapes-vml' is neither a local directory",
                          "did you mean examples/shapes-vlm?")
    assert len(result.stderr) < 250


@pytest.mark.parametrize("flag, value", [
    ("--temperature", "-1"), ("--top-p", "5"), ("--top-k", "-5"), ("--max-tokens", "-3"),
])
def test_an_out_of_range_option_is_refused_before_anything_runs(checkpoint, flag, value):
    result = run_cli("--model", checkpoint, "--prompt", "Hi", flag, value)
    assert_one_line_error(result, flag, "must be")
    assert result.stdout == ""


def test_verbose_says_where_the_sampling_values_came_from(checkpoint, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    config.update(do_sample=False, temperature=0.8, repetition_penalty=1.2)
    (copy / "generation_config.json").write_text(json.dumps(config))
    result = run_cli("--model", copy, "--prompt", "Hi", "--max-tokens", 4, "--top-p", "0.9",
                     "--verbose")
    assert result.returncode == 0, result.stderr
    line = next(l for l in result.stderr.splitlines() if "sampling:" in l)
    assert "temperature 0.0 (generation_config.json, do_sample false)" in line
    assert "repetition_penalty 1.2 (generation_config.json" in line
    assert "top_p 0.9 (given)" in line and "top_k 0 (default)" in line
