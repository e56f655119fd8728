"""``python -m mlxvlm.generate`` (and ``mlxvlm-generate``): the command line in
``mlxvlm.cli`` over the shared loop."""

from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from mlxvlm.cli import run_generate_cli

    return run_generate_cli(argv)


if __name__ == "__main__":
    raise SystemExit(main())
