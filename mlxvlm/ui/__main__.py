"""``python -m mlxvlm.ui --model M [--model M2 ...] [--models-dir D] [--host 127.0.0.1]
[--port 7860]``: the chat UI."""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

from mlxvlm.cli import (OneLineParser, add_model_arguments, checkpoint_folders, open_listener,
                        port_in_use, ranged, require_extra, run_cli)
from mlxvlm.errors import MlxvlmError
from mlxvlm.model_pool import MIN_LOADED_SECONDS
from mlxvlm.sampling.ranges import NON_NEGATIVE, PORT, POSITIVE, at_least
from mlxvlm.speech.duration import DEFAULT_MAX_SPEECH_SECONDS


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m mlxvlm.ui",
        description="Chat with a vision-language model in the browser (Gradio).",
        conflict_handler="resolve",  # this --model replaces the shared one-model flag
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--model", action="append", default=None,
        help="Local checkpoint directory or Hugging Face repo id; repeat it to offer "
        "several models in a picker (the first is loaded at start, the others when chosen)",
    )
    parser.add_argument(
        "--models-dir", default=None,
        help="Also offer every checkpoint folder (with a config.json) in this directory "
        "(default: none)",
    )
    parser.add_argument(
        "--max-loaded-models", type=ranged(at_least(1)), default=1,
        help="Models kept loaded at once; choosing another unloads the least recently used",
    )
    parser.add_argument(
        "--min-loaded-seconds", type=ranged(NON_NEGATIVE), default=MIN_LOADED_SECONDS,
        help="Seconds a loaded model in use keeps answering its conversations before those "
        f"waiting for another model unload it (default {MIN_LOADED_SECONDS:g}); one idle "
        "for a second gives way at once",
    )
    parser.add_argument(
        "--max-speech-seconds", type=ranged(POSITIVE), default=DEFAULT_MAX_SPEECH_SECONDS,
        help="Seconds of audio one spoken answer may last, for a model that speaks "
        f"(default {DEFAULT_MAX_SPEECH_SECONDS:g})",
    )
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="Address to listen on (default: 127.0.0.1, this machine only)",
    )
    parser.add_argument("--port", type=ranged(PORT), default=7860, help="Port to listen on")
    return parser


def model_names(args: argparse.Namespace) -> list[str]:
    names = list(args.model or [])
    if args.models_dir:
        names += [str(path) for path in checkpoint_folders(args.models_dir)]
    if not names:
        raise MlxvlmError("give --model (repeatable) or --models-dir")
    if args.adapter_path and len(names) > 1:
        raise MlxvlmError("--adapter-path applies to one model; give a single --model")
    return names


def require_free_port(host: str, port: int) -> None:
    """Fail at once, before a load that may take minutes, where Gradio could not listen
    on ``host``:``port``: bound and let go here, the port is Gradio's to bind later."""
    open_listener(host, port).close()


def launch(app, host: str, port: int) -> None:
    try:
        app.queue().launch(server_name=host, server_port=port)
    except OSError as exc:
        # Taken since require_free_port (Gradio says so with its own environment variable).
        if "empty port" in str(exc):
            raise port_in_use(host, port) from None
        raise


def log_to_stderr() -> None:
    """The chat's own lines on stderr (models loaded and unloaded, failed answers);
    Gradio's and its HTTP clients' stay as they are."""
    chat_log = logging.getLogger("mlxvlm.ui")
    if any(getattr(h, "mlxvlm_ui", False) for h in chat_log.handlers):
        return  # main() again in one process
    handler = logging.StreamHandler()
    handler.mlxvlm_ui = True
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    chat_log.addHandler(handler)
    chat_log.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_to_stderr()

    def body() -> int:
        names = model_names(args)
        # Before the slow model load: without the extra, say how to install it; a port
        # that is taken, say so.
        require_extra("ui", "the chat UI", ("gradio",))
        require_free_port(args.host, args.port)
        from mlxvlm.checkpoint.loading import load

        def open_session(name: str):
            model, processor = load(
                name,
                revision=args.revision,
                adapter_path=args.adapter_path,
                trust_remote_code=args.trust_remote_code,
            )
            from mlxvlm.retrieval.api import check_generates

            check_generates(model)  # an embedding model in a chat: said before the page
            # After the model: a wrong --model fails before the slow Gradio import.
            from mlxvlm.ui.app import upload_media_options
            from mlxvlm.ui.session import ChatSession

            return ChatSession(
                model, processor, name, media_options=upload_media_options(),
                max_speech_seconds=args.max_speech_seconds,
            ).start()

        from mlxvlm.ui.models import ModelRegistry

        registry = ModelRegistry(names, open_session, args.max_loaded_models,
                                 args.min_loaded_seconds)
        try:
            # Before the page, and its errors as the loader says them.
            registry.preload(names[0])
            from mlxvlm.ui.app import build_app

            launch(build_app(registry), args.host, args.port)
        finally:
            registry.close()
        return 0

    return run_cli(body)


if __name__ == "__main__":
    raise SystemExit(main())
