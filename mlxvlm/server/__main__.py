"""``python -m mlxvlm.server --model M [--model N ...]``: load the first model and serve
them (``listener.serve``: uvicorn under the connection guards); under mlx.launch, one model
sharded over the ranks (rank 0 serves)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from mlxvlm.cli import (add_sharding_arguments, launched_rank, open_listener, require_extra,
                        run_cli, sharded_load)
from mlxvlm.errors import MlxvlmError
from mlxvlm.server.config import ServerConfig, build_parser, config_from_args

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
        from mlxvlm.distributed.group import launched_group

        config = config_from_args(args)
        sharded = launched_group() is not None
        if sharded:
            single_model(args, config)
        if launched_rank() != 0:  # rank 0 serves HTTP; this rank runs its batch's passes
            follow(args)
            return
        # Before the slow model load: without the extra, say how to install it; a port in
        # use is said at once too, and stays ours while the model loads.
        require_extra("server", "the server", ("fastapi", "uvicorn"))
        from mlxvlm.server.listener import guarded_server, serve

        listener = open_listener(config.host, config.port)
        from mlxvlm.text.tokenization import processor_state
        from mlxvlm.server.app import create_app, create_registry_app
        from mlxvlm.server.chat_completions import describe_sampling_defaults
        from mlxvlm.server.models_registry import ModelRegistry, checkpoint_loader

        if config.host not in _LOOPBACK and not config.api_key:
            logger.warning(
                "listening on %s without --api-key: anyone who can reach this address can "
                "use the model", config.host,
            )
        if sharded:
            model, processor = sharded_load(args)
            logger.info("requests that leave sampling fields out get: %s",
                        describe_sampling_defaults(processor_state(processor).sampling_defaults))
            app = create_app(model, processor, config)
            from mlxvlm.server.sharded_stop import ShardedStop

            server = guarded_server(app, config, log_level=args.log_level)
            engine = app.state.models.service(config.model_id).engine
            with ShardedStop(engine, server):
                server.run(sockets=[listener])
            return
        else:
            registry = ModelRegistry(config, checkpoint_loader(
                config, revision=args.revision, adapter_path=args.adapter_path,
                trust_remote_code=args.trust_remote_code))
            # The first model now (a bad path fails here, not at the first request); any
            # others on first use.
            service = registry.preload(config.model_id)
            logger.info("requests to %r that leave sampling fields out get: %s",
                        config.model_id,
                        describe_sampling_defaults(processor_state(service.processor).sampling_defaults))
            app = create_registry_app(registry)
        serve(app, config, listener, log_level=args.log_level)

    return run_cli(serve)


def follow(args: argparse.Namespace) -> None:
    """A rank other than 0: run rank 0's passes until it releases this rank; a rank 0
    gone (or the launcher) ends this one with status 1, even inside a collective that
    would wait for it forever (see ``distributed.rank_stop``)."""
    from mlxvlm.batching.sharded_follower import follow_batches
    from mlxvlm.distributed.rank_stop import RankStop

    model = sharded_load(args)[0]
    with RankStop(model.sharding.rank, lambda reason: logger.error("stopping: %s", reason)):
        follow_batches(model)


def single_model(args: argparse.Namespace, config: ServerConfig) -> None:
    """Under mlx.launch the ranks shard one model: ``args.model`` becomes its path."""
    if len(config.model_sources) != 1:
        raise MlxvlmError("under mlx.launch the server shards one model: give --model once "
                          "(and no --models-dir)")
    args.model = next(iter(config.model_sources.values()))


if __name__ == "__main__":
    sys.exit(main())
