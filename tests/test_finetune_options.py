"""What gets trained (target modules, last N blocks, the vision side, full fine-tuning),
gradient checkpointing, epochs and gradient accumulation, and the errors for settings that
cannot work."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from finetune_helpers import small_dataset
from mlxvlm import load
from mlxvlm.checkpoint.adapters import WEIGHTS_FILE
from mlxvlm.errors import MlxvlmError
from mlxvlm.finetune import FinetuneConfig, finetune
from mlxvlm.finetune.tuning import apply_tuning

FAMILY = "qwen2_vl"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints.path(FAMILY, "hub")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("options-data"), count=4)


def run(checkpoint, data, output, **options):
    settings = dict(model=str(checkpoint), data=str(data), output=str(output), rank=4, alpha=8,
                    batch_size=2, iters=2, learning_rate=1e-2)
    return finetune(FinetuneConfig(**{**settings, **options}))


def test_target_modules_last_layers_and_vision(checkpoint, data, tmp_path):
    result = run(checkpoint, data, tmp_path / "a", target_modules=["q_proj", "v_proj"], num_layers=1)
    assert result.tuning.modules == ["language_model.model.layers.1.self_attn.q_proj",
                                     "language_model.model.layers.1.self_attn.v_proj"]
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["target_modules"] == [
        "model.language_model.layers.1.self_attn.q_proj",
        "model.language_model.layers.1.self_attn.v_proj",
    ]  # leaf names alone would also select layer 0's
    names = set(mx.load(str(tmp_path / "a" / WEIGHTS_FILE)))
    assert len(names) == 4

    result = run(checkpoint, data, tmp_path / "b", train_vision=True)
    assert any(m.startswith("vision_tower.merger") for m in result.tuning.modules)
    assert any(m.startswith("language_model.") for m in result.tuning.modules)


def test_default_targets_are_listed_by_name(checkpoint, data, tmp_path):
    run(checkpoint, data, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                        "up_proj", "v_proj"]


def test_full_fine_tuning_writes_a_model_that_loads(checkpoint, data, tmp_path):
    result = run(checkpoint, data, tmp_path / "full", method="full", num_layers=1,
                 learning_rate=1e-3)
    assert result.tuning.modules == ["language_model.model.layers.1"]
    tuned, processor = load(tmp_path / "full")
    base, _ = load(checkpoint)
    changed = lambda a, b: not np.array_equal(np.array(a), np.array(b))  # noqa: E731
    assert changed(tuned.layers[1].mlp.up_proj.weight, base.layers[1].mlp.up_proj.weight)
    assert not changed(tuned.layers[0].mlp.up_proj.weight, base.layers[0].mlp.up_proj.weight)
    assert processor.tokenizer is not None


def test_gradient_checkpointing_gives_the_same_weights(checkpoint, data, tmp_path):
    run(checkpoint, data, tmp_path / "plain")
    run(checkpoint, data, tmp_path / "checkpointed", grad_checkpoint=True)
    plain = mx.load(str(tmp_path / "plain" / WEIGHTS_FILE))
    again = mx.load(str(tmp_path / "checkpointed" / WEIGHTS_FILE))
    for name, value in plain.items():
        np.testing.assert_allclose(np.array(again[name]), np.array(value), atol=1e-6, err_msg=name)
    # The block class is itself again afterwards.
    model, _ = load(checkpoint)
    assert type(model.layers[0]).__call__.__name__ == "__call__"


def test_epochs_and_accumulation_set_the_number_of_steps(checkpoint, data, tmp_path):
    # 4 examples, batches of 2, 2 batches a step: one step per epoch.
    result = run(checkpoint, data, tmp_path / "e", iters=None, epochs=3, grad_accumulation_steps=2)
    assert result.steps == 3


def test_settings_that_cannot_work(checkpoint, data, tmp_path):
    model, _ = load(checkpoint)
    with pytest.raises(MlxvlmError, match="nope_proj"):
        apply_tuning(model, "lora", target_modules=["nope_proj"])
    with pytest.raises(MlxvlmError, match="full fine-tuning"):
        apply_tuning(model, "full", target_modules=["q_proj"])
    with pytest.raises(MlxvlmError, match="not both"):
        FinetuneConfig(model="m", data="d", iters=3, epochs=1)
    with pytest.raises(MlxvlmError, match="--batch-size"):
        FinetuneConfig(model="m", data="d", batch_size=0)
    with pytest.raises(MlxvlmError, match="no such folder or file"):
        run(checkpoint, tmp_path / "missing.jsonl", tmp_path / "out")
