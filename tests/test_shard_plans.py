"""How a model is split before its weights are read, in one process: a stand-in group of
N ranks (``prepare`` asks a group only its rank and size). Every family's tiny model
splits both ways over two ranks; counts that cannot split get one line of advice that
names what works, never a contradiction; key/value heads repeated for the ranks compute
what the unrepeated ones do. (Two real ranks: tests/test_distributed.py.)"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from tiny import BUILDERS

from mlxvlm.checkpoint.loading import read_config
from mlxvlm.distributed import pipeline_split, sharding, tensor_split
from mlxvlm.errors import MlxvlmError
from mlxvlm.models import get_family


class StandInGroup:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def build(tiny_checkpoints, family: str):
    config = read_config(tiny_checkpoints.path(family, "hub"))
    return get_family(config["model_type"]).Model.from_config(config)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_every_family_splits_both_ways_over_two_ranks(tiny_checkpoints, family):
    for mode in ("tensor", "pipeline"):
        held = []
        for rank in (0, 1):
            model = build(tiny_checkpoints, family)
            plan, dropped = sharding.prepare(model, StandInGroup(rank, 2), mode)
            assert plan.mode == mode
            held.append(plan.layers)
            # Rank 1 reads none of the towers; rank 0 all of them.
            text = sharding.text_model_path(model)
            towers = [name for name in dropped if not name.startswith(text)]
            assert (not towers) if rank == 0 else towers
        if mode == "pipeline":  # the two runs cover the layers once, rank 1 the first ones
            (start0, end0), (start1, end1) = held
            assert start1 == 0 and end1 == start0 and end0 == plan.num_layers


def test_query_heads_that_do_not_split_advise_the_pipeline(tiny_checkpoints):
    model = build(tiny_checkpoints, "gemma3")  # 2 query heads, 6 layers
    with pytest.raises(MlxvlmError) as refused:
        sharding.prepare(model, StandInGroup(0, 3), "tensor")
    message = str(refused.value)
    assert "2 attention heads do not split over 3 ranks" in message
    assert message.endswith("run with --pipeline (each rank a run of layers)")
    assert "\n" not in message
    # ...and the pipeline it names splits over those ranks:
    plan, _ = sharding.prepare(build(tiny_checkpoints, "gemma3"), StandInGroup(0, 3), "pipeline")
    assert plan.layers == (4, 6)


def test_too_few_layers_for_the_ranks_advise_what_works(tiny_checkpoints):
    model = build(tiny_checkpoints, "qwen2_vl")  # 2 layers
    with pytest.raises(MlxvlmError) as refused:
        sharding.prepare(model, StandInGroup(0, 4), "pipeline")
    # Tensor mode cannot split 2 heads over 4 ranks either: the advice names only ranks.
    assert str(refused.value) == "2 layers cannot be split over 4 ranks; use at most 2 ranks"
    model = build(tiny_checkpoints, "gemma3")  # 6 layers
    with pytest.raises(MlxvlmError) as refused:
        sharding.prepare(model, StandInGroup(0, 8), "pipeline")
    assert "use at most 6 ranks" in str(refused.value)


@pytest.mark.parametrize("heads, kv_heads, ranks, repeats", [
    (8, 8, 2, 1), (8, 2, 2, 1), (8, 1, 2, 2), (8, 1, 4, 4), (8, 2, 8, 4), (12, 3, 2, 2),
    (6, 3, 4, None), (3, 1, 2, None),
])
def test_kv_repeats(heads, kv_heads, ranks, repeats):
    assert tensor_split.kv_repeats(heads, kv_heads, ranks) == repeats


@pytest.mark.parametrize("quantized", (False, True))
def test_repeated_key_value_heads_attend_as_the_originals(quantized):
    """A grouped-query attention (4 query heads, 1 key/value head) with its key/value
    head repeated twice, as for two ranks, gives the original's output."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=32, num_key_value_heads=1)
    mx.random.seed(0)
    attention = llama.Attention(args)
    if quantized:
        nn.quantize(attention, group_size=32, bits=4)
    x = mx.random.normal((1, 5, 64))
    expected = attention(x, mask="causal")
    for name in ("k_proj", "v_proj"):
        tensor_split._repeat_heads(attention[name], attention.n_kv_heads, 2)
    attention.n_kv_heads = 2
    assert attention.k_proj(x).shape[-1] == 2 * 16
    assert mx.allclose(attention(x, mask="causal"), expected, atol=1e-5).item()


def test_kv_sharing_layers_stay_beside_their_source():
    """Gemma 3n's and Gemma 4's last layers attend over earlier layers' keys and values:
    a pipeline split never puts a run's edge between them."""

    class Decoder:
        layers = [None] * 6
        layer_idx_to_cache_idx = [0, 1, 2, 3, 2, 3]  # layers 4, 5 read 2's and 3's

    assert pipeline_split.split(Decoder(), 2) == [4, 2]  # rank 0 from layer 2 on
    assert pipeline_split.split(Decoder(), 3) == [4, 1, 1]
    Decoder.layer_idx_to_cache_idx = [0, 0, 0, 0, 0, 0]
    assert pipeline_split.split(Decoder(), 2) is None


# The families whose text models hold sparse-MoE blocks (mlx-lm's ``switch_mlp`` beside a
# router, some with shared experts): GLM-4.5's, Qwen3-MoE's and Qwen3-Next's blocks
# reduce their own output given a ``sharding_group``; DeepSeek-MoE's has no reduction.
SPARSE_MOE_FAMILIES = ("deepseek_ocr2", "glm4v_moe", "qwen3_5_moe", "qwen3_omni_moe",
                       "qwen3_vl_moe")


def _sparse_moe_layer(tiny_checkpoints, family: str) -> nn.Module:
    model = build(tiny_checkpoints, family)
    decoder = sharding._decoder(sharding._module_at(model, sharding.text_model_path(model)))
    return next(layer for layer in decoder.layers if "switch_mlp" in layer.mlp)


@pytest.mark.parametrize("family", SPARSE_MOE_FAMILIES)
def test_a_split_sparse_moe_block_is_summed_over_the_ranks(tiny_checkpoints, family,
                                                           monkeypatch):
    """Each rank's share of a sparse-MoE block (its slice of every routed and shared
    expert) is a partial sum: the layer's block, once split, ends in one all-reduce of
    its output, and the two ranks' partials add up to the whole block's output. The
    all-reduce is a recording stand-in (one process): it returns this rank's partial."""
    from mlx.utils import tree_map

    whole = _sparse_moe_layer(tiny_checkpoints, family).mlp
    mx.random.seed(0)  # routers built as zeros would route every token alike
    whole.update(tree_map(lambda p: 0.5 * mx.random.normal(p.shape).astype(p.dtype),
                          whole.parameters()))
    x = mx.random.normal((1, 5, whole.switch_mlp.gate_proj.weight.shape[-1]))
    expected = whole(x)
    reduced = []

    def all_sum(y, group=None, stream=None):
        reduced.append(y)
        return y

    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    partials = []
    for rank in (0, 1):
        layer = _sparse_moe_layer(tiny_checkpoints, family)
        layer.mlp.update(whole.parameters())
        tensor_split.split_layers([layer], StandInGroup(rank, 2))
        reduced.clear()
        out = layer.mlp(x)
        assert reduced and reduced[-1] is out, "the block's output is left unreduced"
        partials.append(out)
    assert not mx.allclose(partials[0], expected, atol=1e-3).item()  # a rank's is partial
    assert mx.allclose(partials[0] + partials[1], expected, atol=1e-4).item()
