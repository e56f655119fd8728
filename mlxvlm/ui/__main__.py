"""``python -m mlxvlm.ui --model M [--host 127.0.0.1] [--port 7860]``: the chat UI."""

from __future__ import annotations

import argparse
from typing import Sequence

from mlxvlm.cli import OneLineParser, add_model_arguments, ranged, require_extra, run_cli
from mlxvlm.option_ranges import PORT


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m mlxvlm.ui",
        description="Chat with a vision-language model in the browser (Gradio).",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="Address to listen on (default: 127.0.0.1, this machine only)",
    )
    parser.add_argument("--port", type=ranged(PORT), default=7860, help="Port to listen on")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        # Before the slow model load: without the extra, say how to install it.
        require_extra("ui", "the chat UI", ("gradio",))
        from mlxvlm.loading import load

        model, processor = load(
            args.model,
            revision=args.revision,
            adapter_path=args.adapter_path,
            trust_remote_code=args.trust_remote_code,
        )
        # After the model: a wrong --model fails before the slow Gradio import.
        from mlxvlm.ui.app import build_app, upload_media_options
        from mlxvlm.ui.session import ChatSession

        session = ChatSession(
            model, processor, args.model, media_options=upload_media_options()
        ).start()
        try:
            build_app(session).queue().launch(server_name=args.host, server_port=args.port)
        finally:
            session.close()
        return 0

    return run_cli(body)


if __name__ == "__main__":
    raise SystemExit(main())
