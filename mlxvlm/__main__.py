"""``python -m mlxvlm`` (and ``mlxvlm``): the list of commands, and ``mlxvlm COMMAND ...``
runs that command as ``python -m mlxvlm.COMMAND ...`` (or ``mlxvlm-COMMAND``) does.

Only the chosen command's module is imported, when it runs: the list itself costs nothing
beyond the package's own import.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from typing import NamedTuple, Sequence

EXIT_USAGE = 2  # as mlxvlm.cli's, which this module does not import (it is not cheap)


class Command(NamedTuple):
    name: str
    module: str  # its main(argv) is the command; pyproject's mlxvlm-<name> script is it too
    summary: str


COMMANDS = (
    Command("generate", "mlxvlm.generate.__main__",
            "answer a prompt about images, video or audio"),
    Command("server", "mlxvlm.server.__main__",
            "OpenAI- and Anthropic-compatible HTTP server"),
    Command("ui", "mlxvlm.ui.__main__", "chat with a model in the browser (Gradio)"),
    Command("embed", "mlxvlm.embed.__main__",
            "embed texts and pictures, rank them against a query, index a folder"),
    Command("finetune", "mlxvlm.finetune.__main__",
            "fine-tune a model (LoRA, DoRA, QLoRA or full) on conversations"),
    Command("convert", "mlxvlm.convert",
            "convert a Hugging Face model to MLX, optionally quantized"),
    Command("fuse", "mlxvlm.fuse", "merge a fine-tuned adapter into its base model"),
    Command("benchmark", "mlxvlm.benchmark", "time a model's prompt and generation"),
)
BY_NAME = {command.name: command for command in COMMANDS}


def command_list() -> str:
    width = max(len(c.name) for c in COMMANDS)
    rows = [f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS]
    return "\n".join([
        "usage: mlxvlm COMMAND [options]   (or: python -m mlxvlm COMMAND [options])",
        "",
        "Vision-language and omni models with MLX. Commands:",
        *rows,
        "",
        "Each also runs as mlxvlm-COMMAND or python -m mlxvlm.COMMAND (mlxvlm-generate, "
        "python -m mlxvlm.generate, ...).",
        "mlxvlm COMMAND --help lists a command's options. In a clone, the demo model:",
        "  mlxvlm generate --model examples/shapes-vlm --image examples/images/red-circle.png",
    ])


def unknown_command(given: str) -> str:
    close = difflib.get_close_matches(given, list(BY_NAME), n=1, cutoff=0.5)
    hint = f": did you mean {close[0]}?" if close else ""
    return (f"error: unknown command {given!r}{hint} (commands: {', '.join(BY_NAME)}; "
            "see mlxvlm --help)")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(command_list())
        return 0
    if args[0] == "--version":
        from mlxvlm import __version__

        print(f"mlxvlm {__version__}")
        return 0
    command = BY_NAME.get(args[0])
    if command is None:
        if args[0].startswith("-"):  # an option before any command, e.g. mlxvlm --model m
            print(f"error: give a command before the options ({', '.join(BY_NAME)}), e.g. "
                  f"mlxvlm generate {' '.join(args)}", file=sys.stderr)
        else:
            print(unknown_command(args[0]), file=sys.stderr)
        return EXIT_USAGE
    return importlib.import_module(command.module).main(args[1:]) or 0


if __name__ == "__main__":
    raise SystemExit(main())
