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
