"""Nothing at run time imports torch, even where it is installed: load + generate, the
server answering a request, and the UI, each in a fresh process (the test process itself
has transformers' torch support on, see conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
IMAGE_SIZE = (64, 48)

# Records where torch (or a companion package) is first imported from, if anything does:
# a real import, not the find_spec() probes availability checks make.
WATCH = textwrap.dedent(
    """
    import sys, traceback
    WATCHED = {"torch", "torchvision", "torchaudio", "torchcodec"}
    first_import = []

    class Watch:
        def find_spec(self, name, path=None, target=None):
            if name in WATCHED and not first_import:
                stack = traceback.extract_stack()[:-1]
                if not any("importlib.util" in f.filename or f.filename.endswith("importlib/util.py")
                           for f in stack):
                    first_import.append([f"{f.filename}:{f.lineno} {f.line}" for f in stack
                                         if "frozen" not in f.filename])
            return None

    sys.meta_path.insert(0, Watch())

    def report(step):
        loaded = sorted(WATCHED & set(sys.modules))
        print("REPORT " + __import__("json").dumps(
            {"step": step, "loaded": loaded, "stack": first_import[:1]}), flush=True)
    """
)


def run_child(body: str, checkpoint: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "MLXVLM_ALLOW_TORCH"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    script = WATCH + "\nCHECKPOINT = " + repr(str(checkpoint)) + "\n" + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert reports, done.stdout + done.stderr
    return reports


def assert_torch_free(reports: list[dict]):
    for report in reports:
        assert report["loaded"] == [], (
            f"after {report['step']}: {report['loaded']} imported from\n"
            + "\n".join(report["stack"][0] if report["stack"] else [])
        )


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    pytest.importorskip("torch")  # the point: torch is installed and importable
    return tiny_checkpoints.path("qwen2_vl", "hub")


def test_load_and_generate_import_no_torch(checkpoint):
    reports = run_child(
        """
        import importlib.util
        import mlxvlm
        report("import mlxvlm")
        model, processor = mlxvlm.load(CHECKPOINT)
        report("load")
        from tiny import make_image
        out = mlxvlm.generate(model, processor, "Describe this image.", make_image(64, 48, seed=1),
                              max_tokens=4)
        assert out.generation_tokens == 4
        report("generate")
        assert importlib.util.find_spec("torch") is not None  # torch is still there to import
        import torch
        report("program's own import torch")
        """,
        checkpoint,
    )
    assert_torch_free(reports[:-1])
    assert reports[-1]["loaded"][:1] == ["torch"]  # the program itself can still import it


def test_lfm2_vl_images_import_no_torch(tiny_checkpoints):
    """LFM2-VL's image processor is mlxvlm's (transformers' needs torchvision): an image
    prompt, tiled, loads and generates without torch."""
    pytest.importorskip("torch")
    reports = run_child(
        """
        import mlxvlm
        model, processor = mlxvlm.load(CHECKPOINT)
        from tiny import make_image
        out = mlxvlm.generate(model, processor, "Describe this image.", make_image(112, 84, seed=1),
                              max_tokens=4)
        assert out.generation_tokens == 4 and out.prompt_tokens > 64
        report("generate")
        """,
        tiny_checkpoints.path("lfm2_vl", "hub"),
    )
    assert_torch_free(reports)


def test_minicpm_ocr_images_import_no_torch(tiny_checkpoints):
    """MiniCPM-OCR's image processor is mlxvlm's (transformers' needs torchvision): a
    picture cut into slices loads and generates without torch."""
    pytest.importorskip("torch")
    reports = run_child(
        """
        import mlxvlm
        model, processor = mlxvlm.load(CHECKPOINT)
        from tiny import make_image
        out = mlxvlm.generate(model, processor, "Describe this image.", make_image(80, 56, seed=1),
                              max_tokens=4)
        assert out.generation_tokens == 4 and out.prompt_tokens > 80
        report("generate")
        """,
        tiny_checkpoints.path("minicpm_ocr", "hub"),
    )
    assert_torch_free(reports)


def test_glm4v_video_imports_no_torch(tiny_checkpoints, tmp_path):
    """GLM-4.6V's video processor is mlxvlm's (transformers' needs torchvision): a video
    prompt (frames sampled, resized, timestamped) loads and generates without torch."""
    pytest.importorskip("torch")
    from av_media import coloured_frames, write_video

    video = write_video(tmp_path / "clip.mp4", coloured_frames(20, 96, 64, seed=3), fps=10)
    reports = run_child(
        f"""
        import mlxvlm
        model, processor = mlxvlm.load(CHECKPOINT)
        messages = [{{"role": "user", "content": [{{"type": "video", "video": {str(video)!r}}},
                                                  {{"type": "text", "text": "What is shown?"}}]}}]
        out = mlxvlm.generate(model, processor, messages, max_tokens=4)
        assert out.generation_tokens == 4 and out.prompt_tokens > 40
        report("generate")
        """,
        tiny_checkpoints.path("glm4v", "hub"),
    )
    assert_torch_free(reports)


def test_minicpmv4_6_video_imports_no_torch(tiny_checkpoints, tmp_path):
    """MiniCPM-V 4.6's video processor is mlxvlm's (transformers' needs torchvision): a
    video prompt (a frame a second, each frame's views) loads and generates without torch."""
    pytest.importorskip("torch")
    from av_media import coloured_frames, write_video

    video = write_video(tmp_path / "clip.mp4", coloured_frames(25, 48, 32, seed=3), fps=10)
    reports = run_child(
        f"""
        import mlxvlm
        model, processor = mlxvlm.load(CHECKPOINT)
        messages = [{{"role": "user", "content": [{{"type": "video", "video": {str(video)!r}}},
                                                  {{"type": "text", "text": "What is shown?"}}]}}]
        out = mlxvlm.generate(model, processor, messages, max_tokens=4)
        assert out.generation_tokens == 4 and out.prompt_tokens > 40
        report("generate")
        """,
        tiny_checkpoints.path("minicpmv4_6", "hub"),
    )
    assert_torch_free(reports)


def test_server_answering_a_request_imports_no_torch(checkpoint):
    reports = run_child(
        """
        import httpx
        import mlxvlm
        from server_harness import LiveServer
        model, processor = mlxvlm.load(CHECKPOINT)
        with LiveServer(model, processor) as server:
            report("server app")
            response = httpx.post(
                f"{server.base_url}/v1/chat/completions",
                json={"model": "tiny-qwen2-vl", "max_tokens": 3,
                      "messages": [{"role": "user", "content": "Hello"}]},
                timeout=120,
            )
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] is not None
            report("one request served")
        """,
        checkpoint,
    )
    assert [r["step"] for r in reports] == ["server app", "one request served"]
    assert_torch_free(reports)


def test_ui_imports_no_torch(checkpoint):
    reports = run_child(
        """
        import mlxvlm
        import mlxvlm.ui.__main__
        from mlxvlm.ui.app import build_app, upload_media_options
        from mlxvlm.ui.session import ChatSession
        report("import the UI")
        model, processor = mlxvlm.load(CHECKPOINT)
        session = ChatSession(model, processor, "tiny", media_options=upload_media_options()).start()
        try:
            build_app(session)
            report("build the UI")
        finally:
            session.close()
        """,
        checkpoint,
    )
    assert_torch_free(reports)


def test_opt_out_leaves_transformers_torch_support_on(checkpoint, monkeypatch):
    # The escape hatch for programs that use transformers' torch models after importing
    # mlxvlm (and the reason this test file runs its checks in fresh processes).
    env = {k: v for k, v in os.environ.items()}
    env["MLXVLM_ALLOW_TORCH"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", "import sys, mlxvlm\n"
         "from transformers.utils import is_torch_available\n"
         "print(is_torch_available(), 'torch' in sys.modules)"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "True"
