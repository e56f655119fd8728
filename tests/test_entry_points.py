"""Every entry point's command line: each option has help text and shows its default,
every numeric option is range-checked, a bad value is one line ``error: ...`` and exit
code 2, and the server and UI without their extras say what to install."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from mlxvlm.cli import build_generate_parser
from mlxvlm.option_ranges import RangeType

ENTRY_POINTS = ["generate", "convert", "fuse", "benchmark", "finetune", "server", "ui"]


def parser_of(name: str) -> argparse.ArgumentParser:
    if name == "generate":
        return build_generate_parser()
    if name == "finetune":
        from mlxvlm.finetune.__main__ import build_parser
    elif name == "server":
        from mlxvlm.server.config import build_parser
    elif name == "ui":
        from mlxvlm.ui.__main__ import build_parser
    else:
        build_parser = __import__(f"mlxvlm.{name}", fromlist=["build_parser"]).build_parser
    return build_parser()


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_option_has_help(name):
    missing = [a.option_strings[0] for a in options(parser_of(name)) if not (a.help or "").strip()]
    assert not missing, f"{name}: no help for {missing}"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_shows_every_default(name):
    parser = parser_of(name)
    text = " ".join(parser.format_help().split())
    for action in options(parser):
        default = action.default
        if default in (None, False, [], argparse.SUPPRESS) or action.dest == "api_key":
            continue
        shown = " ".join(parser._get_formatter()._expand_help(action).split())
        assert "default" in shown.lower(), f"{name} {action.option_strings[0]}: {shown!r}"
        assert shown in text


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_numeric_option_is_range_checked(name):
    unchecked = [a.option_strings[0] for a in options(parser_of(name))
                 if a.type in (int, float) and not a.choices]
    assert not unchecked, f"{name}: {unchecked} take any number; give them a Range"
    assert any(isinstance(a.type, RangeType) or a.choices for a in options(parser_of(name)))


BAD_VALUES = [
    ("generate", ["--model", "m", "--temperature", "-1"], "--temperature"),
    ("generate", ["--model", "m", "--top-p", "5"], "--top-p"),
    ("generate", ["--model", "m", "--top-k", "-5"], "--top-k"),
    ("generate", ["--model", "m", "--min-p", "nan"], "--min-p"),
    ("generate", ["--model", "m", "--max-tokens", "0"], "--max-tokens"),
    ("generate", ["--model", "m", "--seed", str(2**70)], "--seed"),
    ("generate", ["--model", "m", "--repetition-penalty", "0"], "--repetition-penalty"),
    ("generate", ["--model", "m", "--kv-bits", "7"], "--kv-bits"),
    ("generate", ["--model", "m", "--fps", "-2"], "--fps"),
    ("generate", ["--model", "m", "--prefill-step-size", "0"], "--prefill-step-size"),
    ("convert", ["--model", "m", "--q-bits", "0"], "--q-bits"),
    ("fuse", ["--model", "m", "--adapter-path", "a", "--q-group-size", "-64"], "--q-group-size"),
    ("benchmark", ["--model", "m", "--runs", "0"], "--runs"),
    ("finetune", ["--model", "m", "--data", "d", "--rank", "0"], "--rank"),
    ("finetune", ["--model", "m", "--data", "d", "--learning-rate", "-1e-4"], "--learning-rate"),
    ("finetune", ["--model", "m", "--data", "d", "--num-layers", "-2"], "--num-layers"),
    ("server", ["--model", "m", "--port", "70000"], "--port"),
    ("server", ["--model", "m", "--media-timeout", "inf"], "--media-timeout"),
    ("server", ["--model", "m", "--max-queue", "-1"], "--max-queue"),
    ("ui", ["--model", "m", "--port", "-1"], "--port"),
]


@pytest.mark.parametrize("name, argv, flag", BAD_VALUES)
def test_a_value_out_of_range_is_one_line_and_exit_code_2(name, argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser_of(name).parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and flag in err, err


def test_good_values_still_parse():
    args = build_generate_parser().parse_args(
        ["--model", "m", "--temp", "0.7", "--top-p", "1", "--top-k", "0", "--seed", "-3"])
    assert (args.temperature, args.top_p, args.top_k, args.seed) == (0.7, 1.0, 0, -3)
    assert args.min_p is None  # left to the checkpoint's generation_config.json


def run_without(module: str, entry: str, tmp_path, *args):
    """``python -m mlxvlm.<entry>`` where ``module`` cannot be imported (as without the
    extra that installs it)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        f"sys.modules[{module!r}] = None  # 'import {module}' raises ModuleNotFoundError\n"
        "sys.modules['torch'] = None  # not needed, and slow to import\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", f"mlxvlm.{entry}", *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module, entry, extra", [
    ("fastapi", "server", "server"), ("uvicorn", "server", "server"), ("gradio", "ui", "ui"),
])
def test_a_missing_extra_names_the_install_command(module, entry, extra, tmp_path):
    result = run_without(module, entry, tmp_path, "--model", str(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: ") and module in lines[0]
    assert f'pip install -e ".[{extra}]"' in lines[0]
    assert f'pip install "mlxvlm[{extra}]"' in lines[0]


def test_help_works_without_the_extra(tmp_path):
    result = run_without("fastapi", "server", tmp_path, "--help")
    assert result.returncode == 0 and "--max-queue" in result.stdout, result.stderr
