"""Run under mlx.launch by tests/test_distributed.py: greedy tokens of one prompt on a
sharded model, for each checkpoint and mode asked for. Every rank prints what it holds
(its parameters' shapes and dtypes) and rank 0 the tokens, as JSON lines; what a rank
holds goes to a file of its own in the directory named last (a long line on the ranks'
shared stdout could be cut by the other rank's output). A checkpoint
that fails to load on any rank is reported (``{"error": ...}`` from each rank that
failed) and skipped by all, so that one family's failure leaves the others' answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlxvlm  # noqa: F401  (before mlx.core, as a user's program)
import mlx.core as mx
from mlx.utils import tree_flatten

# The ring connects here: both ranks before their slow imports, so that neither waits
# out the other's connection back-off.
mx.distributed.init()

from mlxvlm.generate.follower import follow
from mlxvlm.distributed.jobs import release
from mlxvlm.generate import stream_generate
from mlxvlm.checkpoint.loading import load


MAX_TOKENS = 12  # tests/test_distributed.py's BUDGET


def main(checkpoints: list[str], image: str, modes: list[str], out: Path) -> None:
    for index, checkpoint in enumerate(checkpoints):
        for mode in modes:
            run(checkpoint, image, mode, out / f"{index}-{mode}")


def run(checkpoint: str, image: str, mode: str, out: Path) -> None:
    group = mx.distributed.init()
    try:
        model, processor = load(checkpoint, shard=mode)
        failed = 0
    except Exception as exc:  # noqa: BLE001  (reported, and the test fails on it)
        print(json.dumps({"rank": group.rank(), "checkpoint": checkpoint, "mode": mode,
                          "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        failed = 1
    if mx.distributed.all_sum(mx.array(failed), group=group, stream=mx.cpu).item():
        return
    plan = model.sharding
    held = {"rank": plan.rank, "checkpoint": checkpoint, "mode": mode,
            "describe": plan.describe(),
            "parameters": {k: list(v.shape) for k, v in tree_flatten(model.parameters())},
            "dtypes": {k: str(v.dtype).rsplit(".", 1)[-1]
                       for k, v in tree_flatten(model.parameters())}}
    Path(f"{out}-rank{plan.rank}.json").write_text(json.dumps(held))
    if plan.rank != 0:
        follow(model, processor)
        return
    try:
        tokens = [r.token for r in stream_generate(
            model, processor, "Describe this image.", image, max_tokens=MAX_TOKENS,
            temperature=0.0)]
    finally:
        release(model)
    print(json.dumps({"checkpoint": checkpoint, "mode": mode, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2], sys.argv[3].split(","), Path(sys.argv[4]))
