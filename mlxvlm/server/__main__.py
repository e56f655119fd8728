"""``python -m mlxvlm.server --model M [--model N ...]``: load the first model and serve
them with uvicorn."""

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

        from mlxvlm.sampling_defaults import checkpoint_defaults
        from mlxvlm.server.app import create_registry_app
        from mlxvlm.server.chat import describe_sampling_defaults
        from mlxvlm.server.models_registry import ModelRegistry, checkpoint_loader

        config = config_from_args(args)
        if config.host not in _LOOPBACK and not config.api_key:
            logger.warning(
                "listening on %s without --api-key: anyone who can reach this address can "
                "use the model", config.host,
            )
        registry = ModelRegistry(config, checkpoint_loader(
            config, revision=args.revision, adapter_path=args.adapter_path,
            trust_remote_code=args.trust_remote_code))
        # The first model now (a bad path fails here, not at the first request); any
        # others on first use.
        service = registry.preload(config.model_id)
        logger.info("requests to %r that leave sampling fields out get: %s", config.model_id,
                    describe_sampling_defaults(checkpoint_defaults(service.processor)))
        app = create_registry_app(registry)
        uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)

    return run_cli(serve)


if __name__ == "__main__":
    sys.exit(main())
