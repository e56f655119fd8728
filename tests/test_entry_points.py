"""Every entry point's command line: each option has help text and shows its default,
every numeric option is range-checked, a bad value is one line ``error: ...`` and exit
code 2, and the server and UI without their extras say what to install."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from mlxvlm.generate.__main__ import build_parser as build_generate_parser
from mlxvlm.sampling.ranges import RangeType

ENTRY_POINTS = ["generate", "convert", "fuse", "benchmark", "finetune", "server", "ui", "embed"]


def parser_of(name: str) -> argparse.ArgumentParser:
    if name == "generate":
        return build_generate_parser()
    if name == "finetune":
        from mlxvlm.finetune.__main__ import build_parser
    elif name == "server":
        from mlxvlm.server.config import build_parser
    elif name == "ui":
        from mlxvlm.ui.__main__ import build_parser
    elif name == "embed":  # ``mlxvlm.embed`` is also the API's function
        from mlxvlm.embed.__main__ import build_parser
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


# ------------------------------------------------------------- mistyped flags


# Enough for each parser to get past its required options.
REQUIRED = {"fuse": ["--adapter-path", "a"], "finetune": ["--data", "d"]}


def required(name: str) -> list[str]:
    return ["--model", "m", *REQUIRED.get(name, [])]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_misspelt_flag_names_the_closest_one(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser_of(name).parse_args([*required(name), "--modle", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: unrecognized arguments: --modle x (did you mean --model?) (see --help)\n"


# Other tools' spellings: transformers' --max-new-tokens, llama.cpp's --temp, Python's
# underscores; a suggestion only where the entry point has the flag.
OTHER_SPELLINGS = [
    ("generate", "--img", "--image"),
    ("generate", "--max-new-tokens", "--max-tokens"),
    ("generate", "--max_new_tokens", "--max-tokens"),
    ("generate", "--system-prompt", "--system"),
    ("generate", "--top_p=0.5", "--top-p"),
    ("benchmark", "--images", "--image"),
    ("benchmark", "--max-new-tokens", "--max-tokens"),
    ("server", "--max_concurrency", "--max-concurrency"),
    ("finetune", "--learning_rate", "--learning-rate"),
    ("ui", "--prot", "--port"),
    ("convert", "--model-path", "--model"),
    ("server", "--temp", None),  # the server takes sampling values per request only
    ("generate", "--zzz", None),
]


@pytest.mark.parametrize("name, given, meant", OTHER_SPELLINGS)
def test_another_tools_spelling_names_this_ones(name, given, meant, capsys):
    argv = [*required(name), given] + ([] if "=" in given else ["1"])
    with pytest.raises(SystemExit):
        parser_of(name).parse_args(argv)
    err = capsys.readouterr().err
    assert err.startswith(f"error: unrecognized arguments: {given}") and err.count("\n") == 1
    if meant is None:
        assert "did you mean" not in err
    else:
        assert f"(did you mean {meant}?)" in err, err


def test_several_misspelt_flags_are_each_answered(capsys):
    with pytest.raises(SystemExit):
        build_generate_parser().parse_args(["--model", "m", "--img", "a.png", "--temprature", "1"])
    err = capsys.readouterr().err
    assert "(did you mean --image for --img, --temperature for --temprature?)" in err


# --------------------------------------------------------- python -m mlxvlm


def project_scripts() -> dict[str, str]:
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["project"]["scripts"]


def test_every_command_is_an_installed_script_and_mlxvlm_runs_them():
    from mlxvlm.__main__ import COMMANDS

    scripts = project_scripts()
    assert scripts.pop("mlxvlm") == "mlxvlm.__main__:main"
    assert {f"mlxvlm-{c.name}": f"{c.module}:main" for c in COMMANDS} == scripts
    assert sorted(c.name for c in COMMANDS) == sorted(ENTRY_POINTS)


def test_python_m_mlxvlm_lists_the_commands_and_imports_none(tmp_path):
    env = {**os.environ}
    env.pop("MLXVLM_ALLOW_TORCH", None)
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "mlxvlm"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    names = {script.removeprefix("mlxvlm-") for script in project_scripts() if "-" in script}
    assert names <= rows, done.stdout
    assert "mlxvlm-generate" in done.stdout and "python -m mlxvlm.generate" in done.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    commands = {"mlxvlm.cli", "mlxvlm.generate.__main__", "mlxvlm.embed.__main__",
                "mlxvlm.server", "mlxvlm.ui",
                "mlxvlm.finetune", "mlxvlm.convert", "mlxvlm.fuse", "mlxvlm.benchmark",
                "gradio", "fastapi"}
    assert not imported & commands, imported & commands


def test_mlxvlm_generate_answers_as_mlxvlm_generate_does(capsys):
    from pathlib import Path

    import mlxvlm
    from mlxvlm.__main__ import main

    examples = Path(__file__).resolve().parents[1] / "examples"
    picture, question = examples / "images" / "red-circle.png", "What is in the picture?"
    assert main(["generate", "--model", str(examples / "shapes-vlm"), "--image", str(picture),
                 "--prompt", question, "--max-tokens", "16"]) == 0
    model, processor = mlxvlm.load(examples / "shapes-vlm")
    expected = mlxvlm.generate(model, processor, question, image=picture, max_tokens=16).text
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("argv, says", [
    (["generat", "--model", "m"], "unknown command 'generat': did you mean generate?"),
    (["srever"], "unknown command 'srever': did you mean server?"),
    (["xyz"], "unknown command 'xyz' (commands: generate, server"),
    (["--model", "m"], "give a command before the options"),
])
def test_an_unknown_command_is_one_line_with_the_closest(argv, says, capsys):
    from mlxvlm.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1, err


def test_mlxvlm_help_lists_and_a_commands_help_is_its_own(capsys):
    from mlxvlm.__main__ import main

    assert main(["--help"]) == 0
    assert "finetune" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["benchmark", "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == parser_of("benchmark").format_help()
