"""``python -m mlxvlm.ui``'s command line (the app itself: tests/test_ui.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mlxvlm.errors import MlxvlmError
from mlxvlm.ui.__main__ import build_parser, launch, main
from server_process import free_port

DEMO = Path(__file__).resolve().parents[1] / "examples" / "shapes-vlm"


@pytest.fixture
def taken_port():
    """A port something else listens on, as another program would hold 7860."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_defaults_listen_on_this_machine_only():
    args = build_parser().parse_args(["--model", "some/model"])
    assert (args.host, args.port, args.adapter_path) == ("127.0.0.1", 7860, None)


def test_a_missing_model_is_one_line_and_exit_code_2(tmp_path, capsys):
    # A free port: the default one may be another program's, which is checked first.
    assert main(["--model", str(tmp_path / "missing"), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing" in err and err.count("\n") == 1


def test_models_repeat_and_a_models_dir_adds_its_checkpoints(tmp_path):
    from mlxvlm.ui.__main__ import model_names

    for name in ("b-model", "a-model"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "not-a-model").mkdir()
    args = build_parser().parse_args(
        ["--model", "org/one", "--model", "org/two", "--models-dir", str(tmp_path)])
    assert args.max_loaded_models == 1
    assert model_names(args) == ["org/one", "org/two", str(tmp_path / "a-model"),
                                 str(tmp_path / "b-model")]


def test_bad_model_lists_are_one_line_errors(tmp_path, capsys):
    for argv, says in (
        ([], "--model"),
        (["--models-dir", str(tmp_path)], "no checkpoint folder"),
        (["--model", "a", "--model", "b", "--adapter-path", "x"], "--adapter-path"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and err.count("\n") == 1


@pytest.mark.parametrize("model", [str(DEMO), "/no/such/model"])
def test_a_taken_port_is_one_line_naming_port_before_the_model_loads(taken_port, model):
    """As users start it; a model that does not exist still gets the port's error, so the
    port is checked before any load."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MLXVLM_ALLOW_TORCH", None)  # as a user's process runs: torch-free
    done = subprocess.run(
        [sys.executable, "-m", "mlxvlm.ui", "--model", model, "--port", str(taken_port)],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"error: port {taken_port} on 127.0.0.1 is in use: pass --port N "
                           "(or stop what is using it)\n")
    assert done.stdout == ""


def test_a_port_taken_after_the_check_is_the_same_line(taken_port):
    """Gradio's own refusal (another program took the port while the model loaded)."""
    import gradio as gr

    with gr.Blocks() as app:
        gr.Markdown("nothing")
    with pytest.raises(MlxvlmError, match=f"^port {taken_port} on 127.0.0.1 is in use: pass "
                       r"--port N \(or stop what is using it\)$"):
        launch(app, "127.0.0.1", taken_port)
