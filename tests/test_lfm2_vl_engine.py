"""LFM2-VL's convolution state beyond one greedy answer: the prefix cache across chat
turns (the short convolutions' state snapshot at the end of the shared conversation is
reused, not prefilled again), continuous batching (each sequence its own state, joining
and leaving) and ``max_kv_size`` (only the attention layers rotate), on the tiny
checkpoint of tests/tiny/lfm2_vl.py. The machinery is generic (mlxvlm/generate/
state_cache.py); these check that LFM2's layers (mlx-lm's ``ShortConv``) fit it."""

from __future__ import annotations

from engine_helpers import run_to_end

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

import mlxvlm
from mlxvlm.batching import BatchEngine, SamplingOptions
from mlxvlm.generate.cache import CacheOptions
from mlxvlm.generate.state_cache import StateSnapshots, cache_offset
from mlxvlm.batching.prefix_cache import PrefixCache, image_hash
from mlxvlm.prompt import prepare_inputs
from parity import NEW_TOKENS, user
from tiny import make_image

IMAGE = make_image(112, 84, seed=1)  # 2 x 2 tiles and a thumbnail


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("lfm2_vl", "hub"))


def prepared(loaded, messages, images=()):
    model, processor = loaded
    return prepare_inputs(processor, messages, list(images), feature_names=model.feature_names)



def submit(engine, inputs, images=(), max_tokens=NEW_TOKENS) -> list:
    steps: list = []
    engine.submit(inputs, SamplingOptions(max_tokens=max_tokens), steps.append,
                  image_hashes=[image_hash(i) for i in images])
    return steps


def test_next_turn_resumes_from_the_convolution_snapshot(loaded):
    """Turn 2 repeats turn 1 (an image prompt) and its answer: it resumes from the
    convolutions' snapshot at the end of turn 1's prompt, prefills only the rest, and
    answers as a fresh prefill does."""
    model, processor = loaded
    engine = BatchEngine(model, processor, prefix_cache=PrefixCache(), prefill_step_size=32)
    first_messages = user(None, "Describe this image.")
    first = prepared(loaded, first_messages, [IMAGE])
    first_steps = submit(engine, first, [IMAGE], max_tokens=8)
    run_to_end(engine)
    answer = "".join(step.text for step in first_steps)
    messages = [*first_messages, {"role": "assistant", "content": answer},
                *user("What colours are in it?")]
    second = prepared(loaded, messages, [IMAGE])
    steps = submit(engine, second, [IMAGE])
    run_to_end(engine)

    # LFM2's ChatML renders an answered turn as it rendered the prompt: the whole first
    # prompt (image included) is the second's prefix, and its end-of-prompt snapshot is
    # the longest one within the shared part.
    first_ids = first.input_ids[0].tolist()
    assert second.input_ids[0].tolist()[: len(first_ids)] == first_ids
    assert np.isin(first_ids, list(model.placeholder_token_ids)).any()
    assert steps[0].cached_tokens == len(first_ids)
    assert engine.stats.cached_prompt_tokens == len(first_ids)
    fresh = mlxvlm.generate(model, processor, messages, image=[IMAGE], max_tokens=NEW_TOKENS)
    assert len(fresh.tokens) == NEW_TOKENS
    assert [step.token for step in steps] == fresh.tokens


def test_a_restored_snapshot_continues_as_a_fresh_cache(loaded):
    """The convolutions' state after 3 tokens, restored into a cache that went on to 5
    (its KV caches trimmed back), continues exactly as a cache that saw only the 3."""
    model, _ = loaded
    cache = model.make_cache()
    assert [type(c) for c in cache] == [ArraysCache, KVCache] * 2
    model(mx.array([[11, 12, 13]]), cache)
    snapshots = StateSnapshots()
    snapshots.record(cache)
    model(mx.array([[14, 15]]), cache)
    assert cache_offset(cache) == 5
    snapshots.restore(cache, 3)
    for layer_cache in cache:
        if not isinstance(layer_cache, ArraysCache):
            layer_cache.trim(2)
    fresh = model.make_cache()
    model(mx.array([[11, 12, 13]]), fresh)
    np.testing.assert_array_equal(np.array(model(mx.array([[16]]), cache)),
                                  np.array(model(mx.array([[16]]), fresh)))


def test_requests_join_and_leave_the_batch(loaded):
    """A text request joins while an image one decodes and leaves before it ends; both
    answers are their own alone."""
    model, processor = loaded
    engine = BatchEngine(model, processor, max_batch_size=4)
    long_messages = user(None, "Describe this image.")
    short_messages = [{"role": "user", "content": "Hello! Who are you?"}]
    long_steps = submit(engine, prepared(loaded, long_messages, [IMAGE]), max_tokens=16)
    for _ in range(5):
        engine.step()
    short_steps = submit(engine, prepared(loaded, short_messages), max_tokens=4)
    run_to_end(engine)
    assert engine.stats.peak_batch_size == 2
    expected_long = mlxvlm.generate(model, processor, long_messages, image=[IMAGE], max_tokens=16)
    expected_short = mlxvlm.generate(model, processor, short_messages, max_tokens=4)
    assert [s.token for s in long_steps] == expected_long.tokens
    assert [s.token for s in short_steps] == expected_short.tokens


def test_max_kv_size_rotates_only_the_attention_layers(loaded):
    model, processor = loaded
    messages = user(None, "Describe this image.")
    inputs = prepared(loaded, messages, [IMAGE])
    size = inputs.num_tokens + NEW_TOKENS // 2
    assert [type(c) for c in CacheOptions(max_kv_size=size).make(model, inputs)] == (
        [ArraysCache, RotatingKVCache] * 2)
    unbounded = mlxvlm.generate(model, processor, messages, image=[IMAGE], max_tokens=NEW_TOKENS).tokens
    rotated = mlxvlm.generate(model, processor, messages, image=[IMAGE], max_tokens=NEW_TOKENS,
                              max_kv_size=size).tokens
    assert len(rotated) == NEW_TOKENS
    assert rotated[: NEW_TOKENS // 2] == unbounded[: NEW_TOKENS // 2]
