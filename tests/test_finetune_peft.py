"""PEFT interchange, both ways: adapters trained here load in transformers + peft and give
the same logits; adapters made with peft (non-zero, LoRA and DoRA, rsLoRA, per-module
alpha) load here and give peft's logits. Both on the decoder and on vision towers, among
them Qwen2.5-Omni's, whose fused q/k/v is three layers in transformers. Also: every family
names its modules the transformers way, which is what makes the adapters' tensor names
right."""

from __future__ import annotations

import numpy as np
import pytest

from finetune_helpers import small_dataset
from tiny import GENERATIVE, make_image
from mlxvlm import load
from mlxvlm.checkpoint.adapters import hf_module_parts
from mlxvlm.finetune import FinetuneConfig, finetune
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

IMAGE = make_image(84, 56, seed=3)
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]


def mlx_logits(model, processor) -> np.ndarray:
    inputs = prepare_inputs(processor, MESSAGES, [IMAGE], feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    return np.array(model(inputs.input_ids, embeddings=embeddings, state=state)[0])


def torch_logits(model, processor) -> np.ndarray:
    inputs = prepare_inputs(processor, MESSAGES, [IMAGE])
    # Integers as int64, as transformers' processors give them (Qwen2.5-Omni's rope index
    # needs the attention mask, and writes positions into a tensor of the ids' type).
    kwargs = {k: _torch_tensor(v) for k, v in inputs.features.items() if k in (
        "pixel_values", "image_grid_thw", "image_sizes", "mm_token_type_ids", "attention_mask",
        "spatial_shapes", "pixel_attention_mask", "image_position_ids")}
    with torch.no_grad():
        out = model(input_ids=_torch_tensor(inputs.input_ids), **kwargs)
    return out.logits[0].float().numpy()


def _torch_tensor(value) -> "torch.Tensor":
    value = np.array(value)
    return torch.tensor(value.astype(np.int64) if np.issubdtype(value.dtype, np.integer) else value)


def reference_model(tiny_checkpoints, family):
    """A fresh transformers model from the saved checkpoint (peft changes it in place), as
    transformers 5 saves it (it cannot read every family's Hub layout, e.g. Pixtral's)."""
    model_class = type(tiny_checkpoints.model(family).model)
    path = tiny_checkpoints.path(family, "transformers")
    return model_class.from_pretrained(path, dtype=torch.float32).eval()


# (family, method, train_vision, num_layers, target_modules): num_layers 0 with train_vision
# adapts the vision side alone, so a vision adapter peft misplaced could not hide behind
# the decoder's; Qwen2.5-Omni's cases adapt only its fused qkv, saved as q, k and v.
HYBRID_TARGETS = ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "v_proj", "o_proj"]


# Gemma 3n's image rows already differ by up to 8e-5 without an adapter (MobileNetV5's
# float32 rounding in its features); an adapter amplifies that at one image position
# (row 21), where float32 itself falls short of 1e-4: against transformers run in float64
# there, transformers' float32 is 1.6e-4 off and ours 4.4e-4 (the adapter trained here,
# on an AVX2 EPYC), and every other row of ours is within 1e-4 of float64.
ADAPTED_ATOL = {"gemma3n": 1e-3}


@pytest.mark.parametrize("family,method,train_vision,num_layers,targets", [
    ("qwen2_vl", "lora", False, -1, None),
    ("qwen2_5_vl", "lora", True, -1, None),
    ("qwen2_vl", "dora", True, -1, None),
    ("llava", "lora", True, 0, None),
    ("pixtral", "lora", True, 0, None),
    ("qwen2_5_omni", "lora", True, 0, ["qkv"]),
    ("qwen2_5_omni", "dora", True, 0, ["qkv"]),
    ("paddleocr_vl", "lora", False, -1, None),
    ("paddleocr_vl", "lora", True, 0, ["qkv", "out_proj"]),
    # Qwen3.5: both layer kinds, linear attention's projections and full attention's
    ("qwen3_5", "lora", False, -1, HYBRID_TARGETS),
    ("lfm2_vl", "lora", True, -1, None),
    # attention only: peft does not place an MoE model's dense-MLP adapters (transformers
    # 5 renames MLP weights of such models while loading)
    ("qwen3_omni_moe", "lora", True, -1, ["q_proj", "k_proj", "v_proj", "o_proj", "qkv"]),
    ("gemma4", "lora", False, -1, None),
    ("gemma4_moe", "lora", False, -1, None),
    ("gemma3n", "lora", False, -1, None),
])
def test_adapter_trained_here_loads_in_peft(tiny_checkpoints, tmp_path, family, method,
                                            train_vision, num_layers, targets):
    checkpoint = tiny_checkpoints.path(family, "hub")
    data = small_dataset(tmp_path / "data", count=4)
    finetune(FinetuneConfig(
        model=str(checkpoint), data=str(data), output=str(tmp_path / "adapter"), method=method,
        rank=4, alpha=8, train_vision=train_vision, num_layers=num_layers,
        target_modules=targets, batch_size=2, iters=3, learning_rate=1e-2,
    ))
    model, processor = load(checkpoint, adapter_path=tmp_path / "adapter")
    ours = mlx_logits(model, processor)

    base = reference_model(tiny_checkpoints, family)
    before = torch_logits(base, processor)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    theirs = torch_logits(adapted, processor)
    assert np.abs(theirs - before).max() > 1e-2  # the trained adapter changes the model
    np.testing.assert_allclose(ours, theirs, atol=ADAPTED_ATOL.get(family, 1e-4), rtol=1e-4)


DECODER_TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
# peft's regex form of target_modules (a full match of the module path): vision towers only.
LLAVA_TOWER = r"model\.vision_tower\..*\.(q_proj|v_proj|out_proj|fc1|fc2)"
PIXTRAL_TOWER = r"model\.vision_tower\..*\.(q_proj|o_proj|gate_proj|down_proj)"
OMNI_QKV = r"model\.visual\.blocks\.\d+\.attn\.(q|k|v)"
OMNI_QV = r"model\.visual\.blocks\.\d+\.attn\.(q|v)"
PADDLE_TOWER_QV = r"model\.visual\.vision_model\.encoder\.layers\.\d+\.self_attn\.(q_proj|v_proj)"
# LFM2's convolution and attention blocks and its MLP, and the NaFlex tower.
LFM2_VL_MODULES = r"model\.(language_model|vision_tower)\..*\.(in_proj|out_proj|q_proj|w1|w2|fc1)"
# Gemma 4's and Gemma 3n's text model only (their towers have linear layers of the same
# names: Gemma 4's clippable ones, Gemma 3n's audio attention).
GEMMA_DECODER = r"model\.language_model\..*\.(q_proj|v_proj|o_proj|gate_proj|down_proj)"


@pytest.mark.parametrize("family,options", [
    ("qwen2_vl", {"use_dora": False}),
    ("qwen2_vl", {"use_dora": True}),
    ("qwen2_vl", {"use_rslora": True, "alpha_pattern": {"v_proj": 3.0}}),
    ("llava", {"target_modules": LLAVA_TOWER}),
    ("pixtral", {"target_modules": PIXTRAL_TOWER, "use_dora": True}),
    # q, k and v with their own lora_A (and k its own alpha): one fused layer here
    ("qwen2_5_omni", {"target_modules": OMNI_QKV, "alpha_pattern": {"k": 3.0}}),
    # k left out: its rows of the fused layer keep the base weights (and norms, with DoRA)
    ("qwen2_5_omni", {"target_modules": OMNI_QV, "use_dora": True}),
    # the decoder's and the tower's q_proj/v_proj (fused into qkv here) alike
    ("paddleocr_vl", {"use_dora": False}),
    ("paddleocr_vl", {"target_modules": PADDLE_TOWER_QV, "use_dora": True}),
    ("qwen3_5", {"target_modules": HYBRID_TARGETS + ["in_proj_b", "gate_proj"]}),
    ("lfm2_vl", {"target_modules": LFM2_VL_MODULES}),
    # the thinker's decoder attention, audio tower and vision tower
    ("qwen3_omni_moe", {"target_modules": ["q_proj", "v_proj", "o_proj", "qkv", "fc1"]}),
    ("gemma4", {"target_modules": GEMMA_DECODER}),
    ("gemma3n", {"target_modules": GEMMA_DECODER}),
], ids=["lora", "dora", "rslora-alpha-pattern", "llava-tower", "pixtral-tower-dora",
        "omni-qkv-alpha-pattern", "omni-qv-dora",
        "paddleocr-decoder-and-tower", "paddleocr-tower-qv-dora",
        "qwen3_5-both-layer-kinds", "lfm2-vl-conv-attention-tower", "qwen3-omni-thinker",
        "gemma4-decoder", "gemma3n-decoder"])
def test_adapter_made_with_peft_loads_here(tiny_checkpoints, tmp_path, family, options):
    base = reference_model(tiny_checkpoints, family)
    model, processor = load(tiny_checkpoints.path(family, "hub"))
    before = torch_logits(base, processor)
    # Seeded here, just before peft draws the adapter: what ran earlier in the process
    # (a fine-tune, a first from_pretrained) leaves torch's generator elsewhere.
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False,  # random A and B: a non-zero update
        **{"target_modules": DECODER_TARGETS, **options},
    )
    adapted = peft.get_peft_model(base, config).eval()
    if options.get("use_dora"):  # move the magnitudes off their initial norms too
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_magnitude_vector" in name:
                    param.mul_(1 + 0.2 * torch.rand_like(param))
    adapted.save_pretrained(tmp_path / "peft-adapter")

    model, processor = load(tiny_checkpoints.path(family, "hub"), adapter_path=tmp_path / "peft-adapter")
    theirs = torch_logits(adapted, processor)
    assert np.abs(theirs - before).max() > 1e-2
    np.testing.assert_allclose(mlx_logits(model, processor), theirs,
                               atol=ADAPTED_ATOL.get(family, 1e-4), rtol=1e-4)


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_fused_layer_adapter_resumes(tiny_checkpoints, tmp_path, method):
    """Resuming (load_adapter_weights) joins the saved q, k and v of Qwen2.5-Omni's fused
    qkv back into the layer exactly; an adapter with only some of them is refused."""
    import mlx.core as mx

    from mlxvlm.checkpoint.adapters import WEIGHTS_FILE, adapter_layers, load_adapter_weights, save_adapter
    from mlxvlm.errors import CheckpointError
    from mlxvlm.finetune.tuning import apply_tuning

    def tuned():
        model, _ = load(tiny_checkpoints.path("qwen2_5_omni", "hub"))
        apply_tuning(model, method, rank=4, alpha=8, target_modules=["qkv"], num_layers=0,
                     train_vision=True)
        return model

    trained = tuned()
    for index, (_, layer) in enumerate(adapter_layers(trained)):
        layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(index))
        if method == "dora":
            layer.m = layer.m * 1.1
    save_adapter(trained, tmp_path / "adapter", alpha=8)
    saved = mx.load(str(tmp_path / "adapter" / WEIGHTS_FILE))
    assert {name.split(".attn.")[1].split(".")[0] for name in saved} == {"q", "k", "v"}

    resumed = tuned()
    load_adapter_weights(resumed, tmp_path / "adapter")
    for (name, layer), (_, expected) in zip(adapter_layers(resumed), adapter_layers(trained)):
        for key in ("lora_a", "lora_b") + (("m",) if method == "dora" else ()):
            np.testing.assert_array_equal(np.array(getattr(layer, key)),
                                          np.array(getattr(expected, key)), err_msg=name)

    partial = {k: v for k, v in saved.items() if ".attn.k." not in k}
    mx.save_safetensors(str(tmp_path / "adapter" / WEIGHTS_FILE), partial)
    with pytest.raises(CheckpointError, match="not all of"):
        load_adapter_weights(tuned(), tmp_path / "adapter")


@pytest.mark.parametrize("family,part", [
    (family, part) for family in sorted(GENERATIVE) for part in ("decoder", "vision")
], ids=lambda value: value)
def test_every_adaptable_layer_has_its_transformers_name(tiny_checkpoints, family, part):
    """hf_module_name inverts each family's sanitize onto transformers' module tree, for
    every layer fine-tuning can adapt: in the decoder blocks, and on the vision side. A
    layer transformers splits (hf_split_modules) maps onto linear layers that together
    have its rows."""
    from mlxvlm.finetune.tuning import candidate_linears

    model, _ = load(tiny_checkpoints.path(family, tiny_layout(family)))
    ours = dict(model.named_modules())
    hf_modules = dict(tiny_checkpoints.model(family).model.named_modules())
    paths = candidate_linears(model, num_layers=-1, train_vision=True)
    decoder = set(candidate_linears(model, num_layers=-1, train_vision=False))
    wrong = []
    for name in [p for p in paths if (p in decoder) == (part == "decoder")]:
        try:
            parts = hf_module_parts(model, name)
        except NotImplementedError:
            parts = [(None, slice(None))]
        out_dims, in_dims = ours[name].weight.shape
        for hf_name, rows in parts:
            hf = hf_modules.get(hf_name)
            wanted = range(out_dims)[rows]
            if not (isinstance(hf, torch.nn.Linear) and hf.out_features == len(wanted)
                    and hf.in_features == in_dims):
                wrong.append((name, hf_name))
        if parts[-1][1].stop not in (None, out_dims):
            wrong.append((name, [hf for hf, _ in parts]))
    assert not wrong, f"{len(wrong)} wrong, e.g. {wrong[:3]}"


def tiny_layout(family: str) -> str:
    from tiny import builder

    return builder(family).LAYOUTS[0]
