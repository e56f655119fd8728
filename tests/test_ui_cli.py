"""``python -m mlxvlm.ui``'s command line (the app itself: tests/test_ui.py)."""

from __future__ import annotations

from mlxvlm.ui.__main__ import build_parser, main


def test_defaults_listen_on_this_machine_only():
    args = build_parser().parse_args(["--model", "some/model"])
    assert (args.host, args.port, args.adapter_path) == ("127.0.0.1", 7860, None)


def test_a_missing_model_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing" in err and err.count("\n") == 1
