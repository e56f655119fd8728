"""Mixture-of-experts banks keep their 16-bit weights on the CPU backend
(``kernels.gathered_half_linear``, ``half_weights.CPUHalfSwitchLinear``).

- the kernel against the float64 product of the chosen experts, for decode-sized and
  prefill-sized inputs, grouped or scattered rows, an out-of-range expert; its
  derivatives against MLX's gather_mm over the float32 bank;
- the layer against mlx-lm's ``SwitchGLU`` on the float32 bank, on all three of its
  paths (one token, a few unsorted, many sorted), with biases; a tensor-split rank's
  slices stay 16-bit and add up to the whole; LoRA wraps it; quantized banks are left as
  they are;
- every MoE family's bf16 checkpoint loads with its banks in bf16 (half the bytes of the
  float32 banks), and gives the logits and greedy tokens of the float32-bank path (the
  same load with the banks cast to float32, as before).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from parity import first_logits_and_greedy_tokens
from test_cpu_kernels import _as_bf16_checkpoint
from tiny import make_image
from mlxvlm import load
from mlxvlm.cpu import half_weights, kernels
from mlxvlm.cpu.half_weights import CPUHalfSwitchLinear, use_half_weight_layers


def _float64_rows(x: mx.array, bank: mx.array, experts: np.ndarray) -> np.ndarray:
    w = np.array(bank.astype(mx.float32), dtype=np.float64)
    return np.einsum("rk,rnk->rn", np.array(x, dtype=np.float64).reshape(-1, x.shape[-1]),
                     w[experts.reshape(-1)])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", ["decode", "few", "scattered", "grouped"])
def test_gathered_half_linear_matches_the_float64_product(dtype, case):
    E, N, K = 6, 37, 72
    bank = mx.random.normal((E, N, K), key=mx.random.key(0)).astype(dtype)
    rng = np.random.default_rng(1)
    if case == "decode":  # one token's experts: one row each
        experts = np.array([4, 1, 3])
    elif case == "few":  # a few tokens: at most 3 rows an expert, scattered
        experts = np.array([[2, 0, 2, 1, 0], [5, 5, 3, 1, 2]])
    elif case == "scattered":  # rows of an expert spread through the input, 1-9 per expert
        experts = rng.integers(0, E, size=(5, 7))
    else:  # sorted, as mlx-lm's SwitchGLU hands long inputs over
        experts = np.sort(rng.integers(0, E - 1, size=61))  # one expert chosen by none
    x = mx.random.normal((*experts.shape, K), key=mx.random.key(2))
    y = kernels.gathered_half_linear(x, bank, mx.array(experts))
    assert y.shape == (*experts.shape, N) and y.dtype == mx.float32
    np.testing.assert_allclose(np.array(y).reshape(-1, N), _float64_rows(x, bank, experts),
                               rtol=1e-5, atol=1e-4)


def test_an_expert_out_of_range_gives_zeros_and_arguments_are_checked():
    bank = mx.random.normal((3, 5, 16), key=mx.random.key(3)).astype(mx.bfloat16)
    x = mx.random.normal((2, 16), key=mx.random.key(4))
    y = np.array(kernels.gathered_half_linear(x, bank, mx.array([1, 3])))
    np.testing.assert_allclose(y[0], _float64_rows(x[:1], bank, np.array([1]))[0],
                               rtol=1e-5, atol=1e-5)
    assert (y[1] == 0).all()
    with pytest.raises(ValueError, match="bfloat16/float16"):
        kernels.gathered_half_linear(x, bank.astype(mx.float32), mx.array([0, 1]))
    with pytest.raises(ValueError, match="last axis"):
        kernels.gathered_half_linear(mx.zeros((2, 15)), bank, mx.array([0, 1]))
    with pytest.raises(ValueError, match="one expert per row"):
        kernels.gathered_half_linear(x, bank, mx.array([0, 1, 2]))
    with pytest.raises(ValueError, match="integers"):
        kernels.gathered_half_linear(x, bank, mx.array([0.0, 1.0]))


def _gather_mm_reference(x, bank, experts):
    w = bank.astype(mx.float32).swapaxes(-1, -2)
    return mx.gather_mm(mx.expand_dims(x, -2), w, rhs_indices=experts).squeeze(-2)


def test_derivatives_are_gather_mms_over_the_float32_bank():
    bank = mx.random.normal((4, 10, 24), key=mx.random.key(5)).astype(mx.bfloat16)
    x = mx.random.normal((7, 24), key=mx.random.key(6))
    experts = mx.array([3, 0, 0, 2, 3, 1, 0])
    cotangent = mx.random.normal((7, 10), key=mx.random.key(7))

    def kernel(x, bank):
        return kernels.gathered_half_linear(x, bank, experts)

    def reference(x, bank):
        return _gather_mm_reference(x, bank, experts)

    _, (gx, gw) = mx.vjp(kernel, [x, bank], [cotangent])
    _, (rx, rw) = mx.vjp(reference, [x, bank], [cotangent])
    np.testing.assert_allclose(np.array(gx), np.array(rx), rtol=1e-5, atol=1e-5)
    assert gw.dtype == mx.bfloat16 and gw.shape == bank.shape
    np.testing.assert_array_equal(np.array(gw.astype(mx.float32)), np.array(rw.astype(mx.float32)))
    tangents = [mx.random.normal(x.shape, key=mx.random.key(8)),
                mx.random.normal(bank.shape, key=mx.random.key(9)).astype(mx.bfloat16)]
    _, (jvp,) = mx.jvp(kernel, [x, bank], tangents)
    # (MLX's gather_mm has no forward mode: the product rule, in float64)
    rows = np.array(experts)
    want = _float64_rows(tangents[0], bank, rows) + _float64_rows(x, tangents[1], rows)
    np.testing.assert_allclose(np.array(jvp), want, rtol=1e-4, atol=1e-4)
    compiled = mx.compile(lambda x: kernel(x, bank) * 2.0)
    np.testing.assert_allclose(np.array(compiled(x)), 2 * np.array(reference(x, bank)),
                               rtol=1e-5, atol=1e-5)


class _Block(nn.Module):
    def __init__(self, switch):
        super().__init__()
        self.switch_mlp = switch


def _bf16_glu_and_float32_twin(bias: bool):
    D, H, E = 64, 32, 8
    half = SwitchGLU(D, H, E, bias=bias)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        layer = half[proj]
        layer.weight = layer.weight.astype(mx.bfloat16)
        if bias:
            layer.bias = mx.random.normal(layer.bias.shape, key=mx.random.key(10))
    twin = SwitchGLU(D, H, E, bias=bias)
    twin.update(half.parameters())
    twin.set_dtype(mx.float32)
    return _Block(half), twin


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("tokens", [1, 5, 40], ids=["decode", "unsorted", "sorted"])
def test_the_layer_computes_switch_glu_of_the_float32_bank(bias, tokens):
    block, twin = _bf16_glu_and_float32_twin(bias)
    count, nbytes = use_half_weight_layers(block)
    banks = [block.switch_mlp[p] for p in ("gate_proj", "up_proj", "down_proj")]
    assert count == 3 and all(type(b) is CPUHalfSwitchLinear for b in banks)
    assert all(b.weight.dtype == mx.bfloat16 for b in banks)
    assert nbytes == sum(b.weight.nbytes for b in banks) == 3 * 8 * 64 * 32 * 2
    x = mx.random.normal((1, tokens, 64), key=mx.random.key(11))
    # mlx-lm sorts from 64 (token, expert) pairs: 40 tokens x 2 experts take that path
    indices = mx.random.randint(0, 8, (1, tokens, 2), key=mx.random.key(12))
    np.testing.assert_allclose(np.array(block.switch_mlp(x, indices)),
                               np.array(twin(x, indices)), rtol=1e-5, atol=1e-5)


def test_a_tensor_split_rank_keeps_its_16_bit_slice_of_every_expert():
    """Each rank's bank (tensor_split's in-place split: its slice of every expert) is kept
    16-bit too, and the two ranks' partial outputs add up to the whole float32 bank's."""
    from test_shard_plans import StandInGroup

    from mlxvlm.distributed import tensor_split

    x = mx.random.normal((1, 5, 64), key=mx.random.key(15))
    indices = mx.random.randint(0, 8, (1, 5, 2), key=mx.random.key(16))
    whole, twin = _bf16_glu_and_float32_twin(bias=False)
    partials = []
    for rank in (0, 1):
        block = _Block(SwitchGLU(64, 32, 8))
        block.update(whole.parameters())
        tensor_split._split_switch_glu(block.switch_mlp, StandInGroup(rank, 2))
        count, nbytes = use_half_weight_layers(block)
        assert count == 3 and nbytes == 3 * 8 * 64 * 16 * 2  # half of each expert's width
        assert all(type(block.switch_mlp[p]) is CPUHalfSwitchLinear
                   and block.switch_mlp[p].weight.dtype == mx.bfloat16
                   for p in ("gate_proj", "up_proj", "down_proj"))
        partials.append(block.switch_mlp(x, indices))
    np.testing.assert_allclose(np.array(partials[0] + partials[1]), np.array(twin(x, indices)),
                               rtol=1e-5, atol=1e-5)


def test_lora_wraps_a_16_bit_bank_and_quantized_banks_stay_as_they_are():
    from mlx_lm.tuner.lora import LoRASwitchLinear

    bank = SwitchLinear(24, 10, 4, bias=False)
    bank.weight = bank.weight.astype(mx.bfloat16)
    half = CPUHalfSwitchLinear(bank)
    float_bank = SwitchLinear(24, 10, 4, bias=False)
    float_bank.weight = bank.weight.astype(mx.float32)
    adapted = LoRASwitchLinear.from_base(half, r=4)
    adapted.lora_b = mx.random.normal(adapted.lora_b.shape, key=mx.random.key(13))
    reference = LoRASwitchLinear.from_base(float_bank, r=4)
    reference.update({"lora_a": adapted.lora_a, "lora_b": adapted.lora_b})
    x = mx.random.normal((1, 3, 1, 1, 24), key=mx.random.key(14))
    indices = mx.array([[[0, 2], [3, 3], [1, 0]]])
    np.testing.assert_allclose(np.array(adapted(x, indices)), np.array(reference(x, indices)),
                               rtol=1e-5, atol=1e-5)
    # Fused back, the bank is a plain SwitchLinear with the adapter's delta in it.
    assert type(adapted.fuse()) is SwitchLinear

    block, _ = _bf16_glu_and_float32_twin(bias=False)
    nn.quantize(block, group_size=32, bits=4)
    before = dict(tree_flatten(block.parameters()))
    assert use_half_weight_layers(block) == (0, 0)
    assert all(type(block.switch_mlp[p]) is QuantizedSwitchLinear
               for p in ("gate_proj", "up_proj", "down_proj"))
    after = dict(tree_flatten(block.parameters()))
    assert all(after[name] is value for name, value in before.items())


# ------------------------------------------------------------- whole MoE checkpoints

MOE_FAMILIES = ["deepseek_ocr2", "qwen3_vl_moe", "qwen3_5_moe", "glm4v_moe", "internvl_moe",
                "gemma4_moe", "qwen3_omni_moe"]
IMAGE = make_image(112, 84, seed=5)
PROMPT = "Describe this image."


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_checkpoint_keeps_16_bit_banks_with_the_float32_banks_results(
        tiny_checkpoints, tmp_path, family, monkeypatch):
    path = _as_bf16_checkpoint(tiny_checkpoints.path(family, "hub"), tmp_path / family)
    model, processor = load(path)
    banks = [(n, m) for n, m in model.named_modules() if isinstance(m, SwitchLinear)]
    assert banks and all(type(m) is CPUHalfSwitchLinear for _, m in banks)
    parameters = dict(tree_flatten(model.parameters()))
    assert all(parameters[f"{n}.weight"].dtype == mx.bfloat16 for n, _ in banks)
    logits, tokens = first_logits_and_greedy_tokens(model, processor, PROMPT, IMAGE, 12)

    # The float32-bank path: the same load with every other fast path (Gemma 4's differs
    # from MLX's own maths by more than this tolerance without any expert bank involved)
    monkeypatch.delitem(half_weights._HALF_LAYERS, SwitchLinear)
    reference, reference_processor = load(path)
    reference_banks = dict(reference.named_modules())
    # The same banks, in float32 there: twice the bytes.
    for name, bank in banks:
        assert reference_banks[name].weight.dtype == mx.float32
        assert reference_banks[name].weight.nbytes == 2 * bank.weight.nbytes
    want_logits, want_tokens = first_logits_and_greedy_tokens(
        reference, reference_processor, PROMPT, IMAGE, 12)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert tokens == want_tokens

