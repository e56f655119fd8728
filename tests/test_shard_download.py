"""A sharded rank's download of a Hub checkpoint: only the safetensors files holding a
tensor the rank keeps, with the configs and tokenizer. The Hub is a local fake here
(``snapshot_download`` copying the files its patterns match, recording them;
``get_safetensors_metadata`` reading the local files' headers), never the network."""

from __future__ import annotations

import fnmatch
import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import mlx.core as mx
import pytest
from test_shard_plans import StandInGroup

from mlxvlm.checkpoint import loading
from mlxvlm.models import get_family

REPO = "someone/tiny-qwen2-vl"
TOWERS, LAYER0, LAYER1, REST = ("towers.safetensors", "layer0.safetensors",
                                "layer1.safetensors", "rest.safetensors")


def file_of(name: str) -> str:
    if name.startswith("visual."):
        return TOWERS
    if name.startswith("model.layers.0."):
        return LAYER0
    if name.startswith("model.layers.1."):
        return LAYER1
    return REST


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory):
    """The tiny Qwen2-VL checkpoint (Hugging Face naming) in four files and an index, as
    large checkpoints are stored on the Hub."""
    from tiny import TinyCheckpoints

    source = TinyCheckpoints(tmp_path_factory.mktemp("tiny")).path("qwen2_vl", "hub")
    repo = tmp_path_factory.mktemp("hub")
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, repo / path.name)
    weights = mx.load(str(source / "model.safetensors"))
    files: dict[str, dict] = {}
    for name, value in weights.items():
        files.setdefault(file_of(name), {})[name] = value
    for filename, tensors in files.items():
        mx.save_safetensors(str(repo / filename), tensors)
    index = {"metadata": {}, "weight_map": {n: file_of(n) for n in weights}}
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    return repo


def header(path: Path) -> dict:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return {k: v for k, v in json.loads(f.read(size)).items() if k != "__metadata__"}


@pytest.fixture
def fake_hub(hub_repo, tmp_path, monkeypatch):
    """The Hub's two calls over ``hub_repo``; returns the snapshot directory and the
    patterns each download asked for."""
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    asked: list[list[str]] = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **_):
        assert repo_id == REPO
        asked.append(list(allow_patterns))
        for path in hub_repo.iterdir():
            if any(fnmatch.fnmatch(path.name, p) for p in allow_patterns):
                shutil.copy(path, snapshot / path.name)
        return str(snapshot)

    def get_safetensors_metadata(repo_id, revision=None, **_):
        assert repo_id == REPO
        files = {}
        for path in sorted(hub_repo.glob("*.safetensors")):
            tensors = {name: SimpleNamespace(shape=info["shape"], dtype=info["dtype"])
                       for name, info in header(path).items()}
            files[path.name] = SimpleNamespace(tensors=tensors, metadata={"format": "pt"})
        return SimpleNamespace(files_metadata=files)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", get_safetensors_metadata)
    return snapshot, asked


def downloaded(snapshot: Path) -> set[str]:
    return {p.name for p in snapshot.glob("*.safetensors")}


@pytest.mark.parametrize("rank, mode, files", [
    (1, "tensor", {LAYER0, LAYER1, REST}),  # every layer's slices; no towers
    (0, "tensor", {TOWERS, LAYER0, LAYER1, REST}),
    (1, "pipeline", {LAYER0, REST}),  # the first layer (and the embeddings, norm)
    (0, "pipeline", {TOWERS, LAYER1, REST}),
])
def test_a_rank_downloads_only_the_files_of_its_shard(fake_hub, rank, mode, files):
    snapshot, asked = fake_hub
    path = loading._download_shard(REPO, None, False, (StandInGroup(rank, 2), mode))
    assert downloaded(path) == files
    # First the configs and tokenizer (no weights), then the shard's files by name.
    assert "*.json" in asked[0] and not any("safetensors" in p for p in asked[0])
    assert {p for p in asked[1] if p.endswith(".safetensors")} == files
    assert (path / "tokenizer.json").exists() and (path / "config.json").exists()


def test_a_pipeline_rank_loads_from_its_files_alone(fake_hub):
    """Rank 1's pruned model takes every tensor it keeps from the files it fetched."""
    path = loading._download_shard(REPO, None, False, (StandInGroup(1, 2), "pipeline"))
    config = loading.read_config(path)
    family = get_family(config["model_type"])
    model = loading.build_model(path, config, family, loading.load_weights_files(path),
                                (StandInGroup(1, 2), "pipeline"))
    assert model.sharding.layers == (0, 1)


def test_offline_the_rank_takes_the_whole_checkpoint(fake_hub, monkeypatch):
    snapshot, asked = fake_hub

    def offline(*_, **__):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", offline)
    path = loading._download_shard(REPO, None, False, (StandInGroup(1, 2), "pipeline"))
    assert downloaded(path) == {TOWERS, LAYER0, LAYER1, REST}
    assert "*.safetensors" in asked[-1]
