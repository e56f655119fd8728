"""Qwen3.5's linear-attention state in every path beyond one greedy answer: the prefix
cache across chat turns (the state snapshot at the end of the shared conversation is
reused, not prefilled again), continuous batching (each sequence its own state, joining
and leaving), ``max_kv_size`` (only the attention layers rotate) and ``kv_bits`` (only
the attention layers are quantized), on the tiny checkpoint of tests/tiny/qwen3_5.py."""

from __future__ import annotations

from engine_helpers import run_to_end

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

import mlxvlm
from mlxvlm.batching import BatchEngine, SamplingOptions, batch_generate
from mlxvlm.generate.cache import CacheOptions
from mlxvlm.generate.state_cache import StateSnapshots, cache_offset, turn_boundaries
from mlxvlm.batching.prefix_cache import PrefixCache, image_hash
from mlxvlm.prompt import prepare_inputs
from parity import NEW_TOKENS, user
from tiny import make_image

IMAGE = make_image(112, 84, seed=1)
OTHER = make_image(84, 56, seed=2)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen3_5", "transformers"))


def prepared(loaded, messages, images=()):
    model, processor = loaded
    return prepare_inputs(processor, messages, list(images), feature_names=model.feature_names)



def submit(engine, inputs, images=(), max_tokens=NEW_TOKENS) -> list:
    steps: list = []
    engine.submit(inputs, SamplingOptions(max_tokens=max_tokens), steps.append,
                  image_hashes=[image_hash(i) for i in images])
    return steps


# ------------------------------------------------------------------------- prefix cache


def test_next_turn_resumes_from_the_state_snapshot(loaded):
    """Turn 2 repeats turn 1's conversation and its answer: it resumes from the linear
    layers' snapshot after turn 1's last end-of-turn token (the generation prompt after
    it is rendered differently once answered), prefills only the rest, and answers as a
    fresh prefill does."""
    model, processor = loaded
    engine = BatchEngine(model, processor, prefix_cache=PrefixCache(), prefill_step_size=16)
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

    first_ids = first.input_ids[0].tolist()
    [boundary] = turn_boundaries(first_ids, engine.eos_token_ids)
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second.input_ids[0].tolist()))
                  if a != b)
    assert 0 < boundary < shared < len(first_ids)  # the boundary is inside the shared part
    assert steps[0].cached_tokens == boundary
    assert engine.stats.cached_prompt_tokens == boundary
    fresh = mlxvlm.generate(model, processor, messages, image=[IMAGE], max_tokens=NEW_TOKENS)
    assert [step.token for step in steps] == fresh.tokens


def test_a_prompt_reuses_only_snapshot_lengths(loaded):
    """A prompt that shares the first prompt up to its image (another picture of the same
    size) may reuse only a length where the linear state was recorded: the end of a
    prefill chunk before the image, not the exact shared length."""
    model, processor = loaded
    engine = BatchEngine(model, processor, prefix_cache=PrefixCache(), prefill_step_size=4)
    messages = user(None, "Describe this image.")
    first = prepared(loaded, messages, [IMAGE])
    submit(engine, first, [IMAGE], max_tokens=4)
    run_to_end(engine)
    other_image = make_image(112, 84, seed=3)
    steps = submit(engine, prepared(loaded, messages, [other_image]), [other_image], max_tokens=8)
    run_to_end(engine)
    placeholder = int(np.flatnonzero(np.isin(np.asarray(first.input_ids[0]),
                                             list(model.placeholder_token_ids)))[0])
    assert steps[0].cached_tokens == placeholder // 4 * 4 > 0
    fresh = mlxvlm.generate(model, processor, messages, image=[other_image], max_tokens=8)
    assert [step.token for step in steps] == fresh.tokens


def test_snapshots_restore_the_state_layers_as_they_were(loaded):
    """A snapshot after 3 tokens, restored into a cache that went on to 5 (its KV caches
    trimmed back), continues exactly as a cache that only ever saw the 3."""
    model, _ = loaded
    cache = model.make_cache()
    model(mx.array([[11, 12, 13]]), cache)
    snapshots = StateSnapshots()
    snapshots.record(cache)
    model(mx.array([[14, 15]]), cache)
    assert snapshots.lengths == [3] and cache_offset(cache) == 5
    assert snapshots.longest_within(4) == 3 and snapshots.longest_within(2) is None
    snapshots.restore(cache, 3)
    for layer_cache in cache:
        if not isinstance(layer_cache, ArraysCache):
            layer_cache.trim(2)
    fresh = model.make_cache()
    model(mx.array([[11, 12, 13]]), fresh)
    resumed = model(mx.array([[16]]), cache)
    expected = model(mx.array([[16]]), fresh)
    np.testing.assert_array_equal(np.array(resumed), np.array(expected))


# ---------------------------------------------------------------------------- batching


def test_batched_rows_keep_their_own_state(loaded):
    """Prompts decoded together (different lengths, images or none) give each its own
    greedy answer, as decoded alone."""
    model, processor = loaded
    prompts = [user(None, "Describe this image."), "Tell me a story about a red cat.",
               user(None, None, "Compare the two images.")]
    images = [[IMAGE], None, [IMAGE, OTHER]]
    alone = [mlxvlm.generate(model, processor, p, image=i, max_tokens=12)
             for p, i in zip(prompts, images)]
    together = batch_generate(model, processor, prompts, images, max_tokens=12)
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert alone[0].tokens != alone[1].tokens


def test_requests_join_and_leave_the_batch(loaded):
    """A request joins while another decodes and leaves before it ends; both answers are
    their own alone."""
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


# ------------------------------------------------------------- max_kv_size and kv_bits


def test_max_kv_size_rotates_only_the_attention_layers(loaded):
    model, processor = loaded
    inputs = prepared(loaded, user(None, "Describe this image."), [IMAGE])
    cache = CacheOptions(max_kv_size=inputs.num_tokens + NEW_TOKENS // 2).make(model, inputs)
    kinds = [type(c) for c in cache]
    assert kinds == [ArraysCache, RotatingKVCache] * 2
    # Past its window the rotating cache forgets old tokens while the linear layers keep
    # their whole history: the first half of the answer is the unbounded one's.
    unbounded = mlxvlm.generate(model, processor, user(None, "Describe this image."),
                                image=[IMAGE], max_tokens=NEW_TOKENS).tokens
    rotated = mlxvlm.generate(model, processor, user(None, "Describe this image."),
                              image=[IMAGE], max_tokens=NEW_TOKENS,
                              max_kv_size=inputs.num_tokens + NEW_TOKENS // 2).tokens
    assert len(rotated) == NEW_TOKENS
    assert rotated[: NEW_TOKENS // 2] == unbounded[: NEW_TOKENS // 2]


def test_kv_bits_quantizes_only_the_attention_layers(loaded):
    model, processor = loaded
    options = CacheOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    inputs = prepared(loaded, user(None, "Describe this image."), [IMAGE])
    cache = options.make(model, inputs)
    model(inputs.input_ids[:, :4], cache)
    options.quantize(cache)
    assert [type(c) for c in cache] == [ArraysCache, QuantizedKVCache] * 2
    messages = user(None, "Describe this image.")
    exact = mlxvlm.generate(model, processor, messages, image=[IMAGE], max_tokens=12).tokens
    quantized = mlxvlm.generate(model, processor, messages, image=[IMAGE], max_tokens=12,
                                kv_bits=8, kv_group_size=32, quantized_kv_start=0).tokens
    assert len(quantized) == 12
    assert quantized[:4] == exact[:4]
    assert all(type(c) is not KVCache for c in cache)
