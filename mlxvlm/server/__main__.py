"""``python -m mlxvlm.server --model M``: load the model and serve it with uvicorn."""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from mlxvlm.cli import (add_sharding_arguments, launched_rank, require_extra, run_cli,
                        sharded_load)
from mlxvlm.server.config import build_parser, config_from_args

logger = logging.getLogger("mlxvlm.server")

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    add_sharding_arguments(parser)
    parser.add_argument("--verbose", action="store_true",
                        help="Under mlx.launch: each rank says what it holds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    def serve() -> None:
        if launched_rank() != 0:  # rank 0 serves HTTP; this rank follows its requests
            from mlxvlm.distributed.follower import follow

            follow(*sharded_load(args))
            return
        # Before the slow model load: without the extra, say how to install it.
        require_extra("server", "the server", ("fastapi", "uvicorn"))
        import uvicorn

        from mlxvlm.sampling_defaults import checkpoint_defaults
        from mlxvlm.server.app import create_app
        from mlxvlm.server.chat import describe_sampling_defaults

        config = config_from_args(args)
        if config.host not in _LOOPBACK and not config.api_key:
            logger.warning(
                "listening on %s without --api-key: anyone who can reach this address can "
                "use the model", config.host,
            )
        model, processor = sharded_load(args)  # the whole model without mlx.launch
        logger.info("requests that leave sampling fields out get: %s",
                    describe_sampling_defaults(checkpoint_defaults(processor)))
        app = create_app(model, processor, config)
        uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)

    return run_cli(serve)


if __name__ == "__main__":
    sys.exit(main())
