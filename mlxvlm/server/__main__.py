"""``python -m mlxvlm.server --model M``: load the model and serve it with uvicorn."""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from mlxvlm.cli import require_extra, run_cli
from mlxvlm.server.config import build_parser, config_from_args

logger = logging.getLogger("mlxvlm.server")

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    def serve() -> None:
        # Before the slow model load: without the extra, say how to install it.
        require_extra("server", "the server", ("fastapi", "uvicorn"))
        import uvicorn

        from mlxvlm.loading import load
        from mlxvlm.sampling_defaults import checkpoint_defaults
        from mlxvlm.server.app import create_app
        from mlxvlm.server.chat import describe_sampling_defaults

        config = config_from_args(args)
        if config.host not in _LOOPBACK and not config.api_key:
            logger.warning(
                "listening on %s without --api-key: anyone who can reach this address can "
                "use the model", config.host,
            )
        model, processor = load(
            args.model,
            revision=args.revision,
            adapter_path=args.adapter_path,
            trust_remote_code=args.trust_remote_code,
        )
        logger.info("requests that leave sampling fields out get: %s",
                    describe_sampling_defaults(checkpoint_defaults(processor)))
        app = create_app(model, processor, config)
        uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)

    return run_cli(serve)


if __name__ == "__main__":
    sys.exit(main())
