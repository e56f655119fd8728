"""Training checkpoints: written atomically, found again by ``--resume``.

A checkpoint is a folder ``<output>/checkpoints/step-00000100/`` with the trained weights
(the adapter in PEFT's format, or the trained tensors of a full fine-tune), the
optimizer's state and ``trainer_state.json``. It is written into a hidden staging folder
that is renamed into place only once every file is on disk, so a run killed at any moment
leaves either no folder for that step or a complete one; staging folders left by a killed
run are ignored and removed. The newest ``KEEP`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxvlm.errors import CheckpointError

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
KEEP = 2
_NAME = re.compile(r"^step-(\d{8})$")


def checkpoints_dir(output: Path) -> Path:
    return Path(output) / CHECKPOINTS


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(
    output: Path,
    step: int,
    *,
    write_weights: Callable[[Path], None],
    optimizer_state: dict,
    state: dict,
) -> Path:
    """Write the checkpoint of ``step``; ``write_weights(folder)`` puts the weights in."""
    root = checkpoints_dir(output)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    staging = root / f".step-{step:08d}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        write_weights(staging)
        flat = dict(tree_flatten(optimizer_state))
        mx.save_safetensors(str(staging / OPTIMIZER_FILE), flat)
        (staging / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
        for file in staging.iterdir():
            _fsync(file)
        if final.exists():  # the same step again (a resumed run): replace it
            shutil.rmtree(final)
        staging.rename(final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _prune(root)
    return final


def _prune(root: Path) -> None:
    for old in list_checkpoints(root.parent)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(output: Path) -> list[Path]:
    """Complete checkpoints, oldest first (staging folders are not listed)."""
    root = checkpoints_dir(output)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def remove_staging(output: Path) -> None:
    """Drop the half-written checkpoints of a run that was killed while saving."""
    root = checkpoints_dir(output)
    if root.is_dir():
        for partial in root.glob(".step-*.partial-*"):
            shutil.rmtree(partial, ignore_errors=True)


def read_checkpoint(folder: Path) -> tuple[dict, dict]:
    """``(trainer state, optimizer state tree)`` of a checkpoint folder."""
    try:
        state = json.loads((folder / STATE_FILE).read_text())
        flat = mx.load(str(folder / OPTIMIZER_FILE))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder} cannot be read: {exc}") from None
    return state, tree_unflatten(list(flat.items()))
