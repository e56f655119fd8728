"""``python -m mlxvlm.server --model M``: load the model and serve it with uvicorn."""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from mlxvlm.cli import run_cli
from mlxvlm.server.config import build_parser, config_from_args

logger = logging.getLogger("mlxvlm.server")

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    def serve() -> None:
        import uvicorn

        from mlxvlm.loading import load
        from mlxvlm.server.app import create_app

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
        app = create_app(model, processor, config)
        uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)

    return run_cli(serve)


if __name__ == "__main__":
    sys.exit(main())
