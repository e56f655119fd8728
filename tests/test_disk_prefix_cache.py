"""The prompt cache's disk tier in process (tests/test_prompt_cache_disk.py drives it
through the server): the layer caches the entry point's tests do not reach -- a rotating
window past its size, Llama 3.2 Vision's cross-attention keys of its image -- resumed by
a new engine on the same folder exactly as the memory tier resumes them; the family
states round trip; a layout read from a file builds no class but the ones it may."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import run_to_end
from tiny import make_image

import mlxvlm
from mlxvlm.batching import BatchEngine, SamplingOptions
from mlxvlm.batching import cache_codec
from mlxvlm.batching.disk_prefix_cache import DiskPrefixCache
from mlxvlm.batching.prefix_cache import PrefixCache, image_hash
from mlxvlm.models.gemma3 import ImageBlocks
from mlxvlm.models.layers.cross_attention import CrossAttentionCache, CrossAttentionState
from mlxvlm.models.layers.mrope_decoder import DeepstackFeatures, MRopeState
from mlxvlm.models.paligemma import Prefix
from mlxvlm.prompt import PreparedInputs, prepare_inputs


def run(engine, inputs, images=(), max_tokens=8):
    steps = []
    engine.submit(inputs, SamplingOptions(max_tokens=max_tokens), steps.append,
                  image_hashes=[image_hash(i) for i in images])
    run_to_end(engine)
    return steps


def memory_and_disk(model, processor, folder, **engine_options):
    """Two engines that see the same requests: one with the memory tier only, one whose
    cache is the files a former engine left in ``folder`` (``restart`` makes it)."""

    def engine(disk: bool) -> BatchEngine:
        cache = PrefixCache(disk=DiskPrefixCache(folder, 10**9, "tests") if disk else None)
        return BatchEngine(model, processor, prefix_cache=cache, **engine_options)

    return engine


def restart(engine: BatchEngine, make) -> BatchEngine:
    engine.prefix_cache.close()  # the writes handed over are finished
    return make(True)


def test_a_rotated_window_resumes_whole_after_a_restart(tiny_checkpoints, tmp_path):
    """A text conversation past its --max-kv-size window (reusable only whole): the next
    prompt that extends it resumes from the file as from memory, with the same tokens."""
    model, processor = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))
    make = memory_and_disk(model, processor, tmp_path, max_batch_size=1, max_kv_size=40)
    first = prepare_inputs(processor, "Tell me a long story about a red cat.", [],
                           feature_names=model.feature_names)
    writer, memory = make(True), make(False)
    steps = run(writer, first, max_tokens=48)
    assert [s.token for s in run(memory, first, max_tokens=48)] == [s.token for s in steps]
    assert first.num_tokens + len(steps) > 40  # the window wrapped
    # The conversation so far (all the cache took in: not the last sampled token) and more.
    fed = [s.token for s in steps][:-1]
    ids = np.concatenate([np.asarray(first.input_ids[0]), fed, [steps[-1].token, 11, 12]])
    follow_up = PreparedInputs(mx.array(ids[None].astype(np.int32)))

    resumed = run(restart(writer, make), follow_up)
    expected = run(memory, follow_up)
    assert resumed[0].cached_tokens == expected[0].cached_tokens == first.num_tokens + len(fed)
    assert [s.token for s in resumed] == [s.token for s in expected]


def test_cross_attention_keys_resume_after_a_restart(tiny_checkpoints, tmp_path):
    """Llama 3.2 Vision: the image's keys live in the cross-attention layers' caches and
    its block mask in the state; the same turn asked of a new engine reuses all but its
    last token from the file and answers the same."""
    model, processor = mlxvlm.load(tiny_checkpoints.path("mllama", "hub"))
    image = make_image(60, 40, seed=1)
    make = memory_and_disk(model, processor, tmp_path)
    inputs = prepare_inputs(processor, "Describe this image.", [image],
                            feature_names=model.feature_names)
    writer = make(True)
    steps = run(writer, inputs, [image])
    resumed_engine = restart(writer, make)
    resumed = run(resumed_engine, inputs, [image])
    assert resumed[0].cached_tokens == inputs.num_tokens - 1
    assert [s.token for s in resumed] == [s.token for s in steps]
    entry = next(iter(resumed_engine.prefix_cache._entries.values()))
    cross = [c for c in entry.cache if isinstance(c, CrossAttentionCache)]
    assert cross and all(c.keys is not None for c in cross)
    assert isinstance(entry.state, CrossAttentionState) and entry.state.source is None


def test_family_states_round_trip():
    """What families keep as a prompt's state, numpy arrays of any dtype included."""
    states = [
        MRopeState(mx.arange(12, dtype=mx.int32).reshape(3, 4), 2,
                   DeepstackFeatures(np.array([1, 2]), [mx.ones((2, 8), dtype=mx.bfloat16)])),
        MRopeState(mx.zeros((3, 2), dtype=mx.float32), 0.5),
        ImageBlocks(np.array([-1, 0, 0, -1, 1], dtype=np.int64)),
        Prefix(7),
        CrossAttentionState(np.eye(3, dtype=bool)[None], [3], 4, None, 5, (1, 2)),
        {3: {1: (mx.ones(3), None)}, 7: {1: (mx.zeros(3), np.float64(0.25))}},
    ]
    for state in states:
        layout, tensors = cache_codec.encode(state)
        back = cache_codec.decode(json.loads(json.dumps(layout)), tensors)
        assert type(back) is type(state)
        assert _plain(back) == _plain(state)


def _plain(value):
    if isinstance(value, mx.array):
        return ("mx", str(value.dtype), value.tolist())
    if isinstance(value, np.ndarray):
        return ("np", value.dtype.str, value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return (type(value).__name__, {k: _plain(getattr(value, k)) for k in value.__dataclass_fields__})
    return value


@pytest.mark.parametrize("node", [
    ["dataclass", "os:PathLike", {}],  # not a module a layout may name
    ["dataclass", "subprocess:Popen", {}],
    ["cache", "mlxvlm.batching.prefix_cache:PrefixCache", ["list", []]],  # not a cache
    ["dataclass", "mlxvlm.batching.prefix_cache:PrefixCache", {}],  # not a dataclass
    ["dataclass", "mlxvlm.models.paligemma:Prefix", {"length": ["lit", 1], "x": ["lit", 2]}],
    ["dataclass", "mlxvlm.not_imported:Thing", {}],  # never imported for a file
    ["lit", {"a": 1}],
    ["mx", "missing"],
    ["eval", "1+1"],
])
def test_a_layout_builds_only_what_the_codec_writes(node):
    with pytest.raises(cache_codec.BadLayout):
        cache_codec.decode(node, {})


def test_an_unknown_value_is_not_stored():
    with pytest.raises(cache_codec.NotStorable):
        cache_codec.encode({"a": object()})
