"""The loader beyond the parity tests: checkpoints already in MLX layout (as mlx-community
publishes them), PEFT LoRA adapters, and clear errors."""

from __future__ import annotations

import copy
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tiny import make_image
from mlxvlm import load
from mlxvlm.errors import CheckpointError
from mlxvlm.checkpoint.loading import CONVERTED_MARKER
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

FAMILY = "qwen2_vl"
IMAGE = make_image(112, 84, seed=1)
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]


def first_logits(model, processor) -> np.ndarray:
    inputs = prepare_inputs(processor, MESSAGES, [IMAGE], feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    return np.array(model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)[0])


def save_mlx_layout(model, source, target, marker: bool):
    """What an MLX conversion looks like: our parameter names, the Hub's config."""
    shutil.copytree(source, target)
    for f in target.glob("*.safetensors"):
        f.unlink()
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    if marker:
        config = json.loads((target / "config.json").read_text())
        config[CONVERTED_MARKER] = "mlx"
        (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("marker", [False, True], ids=["mlx-community-names", "marked"])
def test_checkpoint_in_mlx_layout_loads_unchanged(tiny_checkpoints, tmp_path, marker):
    source = tiny_checkpoints.path(FAMILY, "hub")
    model, processor = load(source)
    expected = first_logits(model, processor)
    converted = save_mlx_layout(model, source, tmp_path / "mlx", marker)
    names = mx.load(str(converted / "model.safetensors"))
    assert any(n.startswith("language_model.model.layers.") for n in names)
    again, processor = load(converted)
    np.testing.assert_array_equal(first_logits(again, processor), expected)


def write_peft_adapter(directory, modules, rank, alpha, seed=0):
    """A LoRA adapter exactly as PEFT saves one (names, config keys)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (out_features, in_features) in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = rng.normal(0, 0.3, (rank, in_features)).astype(np.float32)
        tensors[f"base_model.model.{name}.lora_B.weight"] = rng.normal(0, 0.3, (out_features, rank)).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": sorted({n.rsplit(".", 1)[1] for n in modules}), "bias": "none",
        "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return tensors


def test_peft_lora_adapter_matches_merged_reference(tiny_checkpoints, tmp_path):
    tiny = tiny_checkpoints.model(FAMILY)
    reference = copy.deepcopy(tiny.model)
    modules = {}
    for name, module in reference.named_modules():
        if name.endswith(("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")) and "visual" not in name:
            modules[name] = tuple(module.weight.shape)
    assert modules
    rank, alpha = 4, 8
    tensors = write_peft_adapter(tmp_path / "adapter", modules, rank, alpha)
    with torch.no_grad():  # merged weights: W + (alpha / r) * B @ A
        for name in modules:
            a = torch.from_numpy(tensors[f"base_model.model.{name}.lora_A.weight"])
            b = torch.from_numpy(tensors[f"base_model.model.{name}.lora_B.weight"])
            reference.get_submodule(name).weight += (alpha / rank) * (b @ a)

    model, processor = load(tiny_checkpoints.path(FAMILY, "transformers"), adapter_path=tmp_path / "adapter")
    ours = first_logits(model, processor)
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    inputs = processor(text=[text], images=[IMAGE], return_tensors="pt")
    with torch.no_grad():
        expected = reference(**inputs).logits[0].numpy()
        base = tiny.model(**inputs).logits[0].numpy()
    assert np.abs(ours - expected).max() < 1e-4
    assert np.abs(base - expected).max() > 1e-2  # the adapter really changes the model


def test_adapter_errors(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints.path(FAMILY, "hub")
    with pytest.raises(CheckpointError, match="does not exist"):
        load(path, adapter_path=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="adapter_config.json"):
        load(path, adapter_path=tmp_path / "empty")
    write_peft_adapter(tmp_path / "wrong", {"model.language_model.layers.0.self_attn.nope": (8, 8)}, 2, 2)
    with pytest.raises(CheckpointError, match="not a linear layer"):
        load(path, adapter_path=tmp_path / "wrong")


def test_weights_that_do_not_fit_the_config(tiny_checkpoints, tmp_path):
    copy_dir = tmp_path / "model"
    shutil.copytree(tiny_checkpoints.path(FAMILY, "hub"), copy_dir)
    config = json.loads((copy_dir / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (copy_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="do not match"):
        load(copy_dir)


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path)
