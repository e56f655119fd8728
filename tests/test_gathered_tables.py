"""Gemma 3n's and Gemma 4's per-layer embedding table left in the checkpoint's files, its
rows gathered per call (mlxvlm/checkpoint/disk_tables.py): the same logits as the whole
table in memory, for Hugging Face, bfloat16 and quantized checkpoints, sharded ones with
the table in any file, the batching engine and the server; and the table never held
whole (MLX's peak allocation stays below its size)."""

from __future__ import annotations

import gc
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxvlm.checkpoint.loading import load, read_config
from mlxvlm.models.layers.gathered_embedding import GatheredEmbedding

TABLE = "language_model.model.embed_tokens_per_layer"
FAMILIES = ("gemma3n", "gemma4")
# Gemma's per-layer vocabulary, far larger than the tiny models' (their tokens all fall
# in its first rows): the table is most of the checkpoint's bytes.
TABLE_VOCAB = 262_144
PER_LAYER_WIDTH = 16  # x 6 layers: 96 per row, a multiple of the quantization group
GROUP_SIZE = 32
PROMPT = [2, 5, 9, 17, 30, 11, 40, 3, 23, 7]


def table_module(model) -> nn.Module:
    return model.language_model.model.embed_tokens_per_layer


def logits_of(model, ids=PROMPT) -> list[np.ndarray]:
    """A prompt in two chunks, then two decoding steps, each pass's logits."""
    cache = model.make_cache()
    ids = mx.array([ids])
    out = [model(ids[:, :6], cache), model(ids[:, 6:], cache)]
    for token in (4, 8):
        out.append(model(mx.array([[token]]), cache))
    return [np.array(o.astype(mx.float32)) for o in out]


def write_sharded(weights: dict[str, mx.array], directory: Path, table_file: int) -> None:
    """``weights`` in two safetensors files, the table's tensors in file ``table_file``
    (1 or 2), with mlx-lm's index, marked as MLX's layout."""
    names = sorted(weights)
    table = [n for n in names if n.startswith(TABLE + ".")]
    rest = [n for n in names if n not in table]
    half = len(rest) // 2
    files = {1: rest[:half], 2: rest[half:]}
    files[table_file] = files[table_file] + table
    weight_map = {}
    for index, part in files.items():
        name = f"model-{index:05d}-of-00002.safetensors"
        mx.save_safetensors(str(directory / name), {n: weights[n] for n in part},
                            metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(part, name))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def table_dominated(source: Path, directory: Path, table_file: int) -> Path:
    """The tiny checkpoint at ``source`` with a per-layer table of TABLE_VOCAB rows of
    PER_LAYER_WIDTH per layer, bfloat16, in MLX's layout, sharded: the tiny model's
    weights where the shapes agree, the table's first rows its own, the rest drawn."""
    from mlxvlm.convert import copy_side_files
    from mlxvlm.models import get_family

    tiny, _ = load(source, cpu_fast_paths=False, tables_on_disk=False)
    config = read_config(source)
    text = config["text_config"]
    text["vocab_size_per_layer_input"] = TABLE_VOCAB
    text["hidden_size_per_layer_input"] = PER_LAYER_WIDTH
    config["torch_dtype"] = "bfloat16"
    mx.random.seed(7)
    model = get_family(config["model_type"]).Model.from_config(config)
    theirs = dict(tree_flatten(tiny.parameters()))
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name in theirs and theirs[name].shape == value.shape:
            value = theirs[name]
        weights[name] = value.astype(mx.bfloat16)
    layers = len(text["layer_types"])
    table = mx.random.normal((TABLE_VOCAB, layers * PER_LAYER_WIDTH))
    weights[TABLE + ".weight"] = table.astype(mx.bfloat16)
    directory.mkdir(parents=True)
    write_sharded(weights, directory, table_file)
    (directory / "config.json").write_text(json.dumps(config))
    copy_side_files(source, directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    """Per family: the Hugging Face tiny checkpoint, the table-dominated bfloat16 one
    (the table in the second file for Gemma 3n, the first for Gemma 4), and that one
    quantized by ``mlxvlm.convert`` (4 bits, the table too)."""
    from mlxvlm.convert import convert

    root = tmp_path_factory.mktemp("gathered-tables")
    made = {}
    for table_file, family in enumerate(FAMILIES, start=1):
        hub = tiny_checkpoints.path(family, "hub")
        bf16 = table_dominated(hub, root / f"{family}-bf16", 3 - table_file)
        quantized = root / f"{family}-4bit"
        convert(str(bf16), quantized, quantize=True, q_bits=4, q_group_size=GROUP_SIZE)
        made[family] = {"hub": hub, "bf16": bf16, "4bit": quantized}
    return made


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["hub", "bf16", "4bit"])
@pytest.mark.parametrize("cpu_fast_paths", [True, False], ids=["fast-paths", "mlx-layers"])
def test_gathered_rows_give_the_whole_tables_logits(checkpoints, family, kind, cpu_fast_paths):
    path = checkpoints[family][kind]
    whole, _ = load(path, tables_on_disk=False, cpu_fast_paths=cpu_fast_paths)
    gathered, _ = load(path, cpu_fast_paths=cpu_fast_paths)
    assert gathered.tables_on_disk == {TABLE} and not whole.tables_on_disk
    assert isinstance(table_module(gathered), GatheredEmbedding)
    quantized = isinstance(table_module(whole), nn.QuantizedEmbedding)
    assert quantized == (kind == "4bit")
    ids = mx.array([PROMPT[:5], PROMPT[5:]])  # two rows, as a batched step gathers
    rows, want_rows = table_module(gathered)(ids), table_module(whole)(ids)
    assert rows.dtype == want_rows.dtype and rows.shape == want_rows.shape
    np.testing.assert_array_equal(np.array(rows), np.array(want_rows))
    expected = logits_of(whole)
    for got, want in zip(logits_of(gathered), expected, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_the_logits_depend_on_the_gathered_rows(checkpoints, tmp_path):
    """The comparison above can fail: the same checkpoint with one used row of the table
    changed on disk gives other logits."""
    source = checkpoints["gemma3n"]["bf16"]
    changed = tmp_path / "changed"
    shutil.copytree(source, changed)
    file = changed / "model-00002-of-00002.safetensors"
    tensors = mx.load(str(file))
    table = tensors[TABLE + ".weight"]
    tensors[TABLE + ".weight"] = mx.concatenate([table[:PROMPT[3]], -table[PROMPT[3]:PROMPT[3] + 1],
                                                 table[PROMPT[3] + 1:]])
    mx.save_safetensors(str(file), tensors, metadata={"format": "mlx"})
    before = logits_of(load(source)[0])
    after = logits_of(load(changed)[0])
    assert not np.array_equal(before[0], after[0])


@pytest.mark.parametrize("kind", ["bf16", "4bit"])
def test_the_table_is_never_held_whole(checkpoints, kind):
    """MLX's peak allocation while loading and running the model stays below the table's
    size on a checkpoint it dominates; with the whole table it exceeds it."""
    path = checkpoints["gemma3n"][kind]
    peaks = {}
    for on_disk in (True, False):
        gc.collect()  # earlier tests' models (held in reference cycles) freed
        mx.clear_cache()
        mx.reset_peak_memory()
        model, _ = load(path, tables_on_disk=on_disk)
        logits_of(model)
        peaks[on_disk] = mx.get_peak_memory()
        if on_disk:
            table = table_module(model)
            stored = table.stored_bytes
            assert all(v.shape[0] != TABLE_VOCAB for _, v in tree_flatten(model.parameters()))
        del model
    assert peaks[True] < stored < peaks[False], (peaks, stored)


def test_batched_rows_are_gathered_together(checkpoints, monkeypatch):
    """The batching engine's decode steps gather several sequences' rows in one call, and
    its answers are the whole table's."""
    from mlxvlm.batching.api import batch_generate

    path = checkpoints["gemma4"]["4bit"]
    whole, processor = load(path, tables_on_disk=False)
    gathered, _ = load(path)
    calls = []
    original = GatheredEmbedding.__call__

    def spy(self, ids):
        calls.append(tuple(ids.shape))
        return original(self, ids)

    monkeypatch.setattr(GatheredEmbedding, "__call__", spy)
    prompts = ["w1 w2 w3", "a longer prompt of words", "hello"]
    got = batch_generate(gathered, processor, prompts, max_tokens=6, temperature=0.0)
    want = batch_generate(whole, processor, prompts, max_tokens=6, temperature=0.0)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert any(shape[0] > 1 for shape in calls), calls


def test_the_server_answers_concurrent_requests_as_the_whole_table_does(checkpoints):
    """python -m mlxvlm.server on a quantized Gemma 3n checkpoint: concurrent greedy
    requests (batched) answer as one generation each with the table in memory."""
    from server_process import ServerProcess

    from mlxvlm.generate.stream import generate

    path = checkpoints["gemma3n"]["4bit"]
    questions = ["w1 w2 w3", "a longer prompt of words", "hello there"]
    whole, processor = load(path, tables_on_disk=False)
    expected = [generate(whole, processor, [{"role": "user", "content": q}], max_tokens=6,
                         temperature=0.0).text for q in questions]
    with ServerProcess("--model", str(path), "--served-model-name", "gemma") as server:
        client = server.openai_client()

        def ask(question):
            return client.chat.completions.create(
                model="gemma", messages=[{"role": "user", "content": question}],
                max_tokens=6, temperature=0.0).choices[0].message.content

        with ThreadPoolExecutor(len(questions)) as pool:
            answers = list(pool.map(ask, questions))
    assert answers == expected


def test_the_generate_command_says_what_it_left_on_disk(checkpoints):
    """python -m mlxvlm.generate --verbose names the table and the bytes it did not load,
    and answers as ``generate`` does with the whole table."""
    import os
    import subprocess
    import sys

    from mlxvlm.generate.stream import generate

    path = checkpoints["gemma4"]["bf16"]
    whole, processor = load(path, tables_on_disk=False)
    expected = generate(whole, processor, "w1 w2 w3", max_tokens=4, temperature=0.0).text
    assert expected.strip()
    env = {k: v for k, v in os.environ.items() if k != "MLXVLM_ALLOW_TORCH"}
    done = subprocess.run(
        [sys.executable, "-m", "mlxvlm.generate", "--model", str(path), "--prompt", "w1 w2 w3",
         "--max-tokens", "4", "--temperature", "0", "--verbose"],
        capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    stored = TABLE_VOCAB * 6 * PER_LAYER_WIDTH * 2  # bfloat16
    assert (f"[mlxvlm] embedding tables: {TABLE} read from the checkpoint's files row by row "
            f"({stored / 1e9:.2f} GB not loaded)") in done.stderr
    assert expected in done.stdout
