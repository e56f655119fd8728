"""The batching engine under the server, stepped by hand: batched greedy output equals
``generate``'s, per-request options, cancellation at every stage, prefix-cache keys."""

from __future__ import annotations

from engine_helpers import run_to_end

import numpy as np
import pytest
from tiny import make_image

import mlxvlm
from mlxvlm.batching import BatchEngine, SamplingOptions, batch_generate
from mlxvlm.errors import MlxvlmError, PromptTooLongError
from mlxvlm.batching.prefix_cache import PrefixCache, image_hash, prompt_key
from mlxvlm.prompt import prepare_inputs

PROMPTS = [
    "Describe this image.",
    "What is in the picture?",
    "Compare the two images.",
    "A red cat sits on a blue mat",
    "Hello there",
    "The quick brown fox",
    "Here is a photo of my garden.",
    "Sure! The image shows a small house",
]
IMAGES = [
    make_image(64, 64, 1), None, [make_image(56, 80, 2), make_image(64, 64, 3)], None,
    make_image(90, 60, 4), None, make_image(64, 64, 5), None,
]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))


def prepared(loaded, text, images=()):
    model, processor = loaded
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return prepare_inputs(processor, [{"role": "user", "content": content}], list(images),
                          feature_names=model.feature_names)



def test_greedy_batch_equals_generate_alone(loaded):
    model, processor = loaded
    alone = [mlxvlm.generate(model, processor, p, image=i, max_tokens=40)
             for p, i in zip(PROMPTS, IMAGES)]
    together = batch_generate(model, processor, PROMPTS, IMAGES, max_tokens=40)
    for one, batched in zip(alone, together):
        assert batched.tokens == one.tokens
        assert batched.text == one.text
        assert batched.finish_reason == one.finish_reason
        assert batched.prompt_tokens == one.prompt_tokens


@pytest.mark.parametrize("family", ["llava", "lfm2_vl"])
def test_greedy_batch_equals_generate_for_mlx_lm_backbones(tiny_checkpoints, family):
    """Families built on mlx-lm's text models batch through mlx-lm's own batched caches."""
    from tiny import builder

    model, processor = mlxvlm.load(
        tiny_checkpoints.path(family, builder(family).LAYOUTS[0]))
    prompts, images = PROMPTS[:4], [make_image(64, 64, 1), None, make_image(80, 56, 2), None]
    alone = [mlxvlm.generate(model, processor, p, image=i, max_tokens=24)
             for p, i in zip(prompts, images)]
    together = batch_generate(model, processor, prompts, images, max_tokens=24)
    assert [b.tokens for b in together] == [a.tokens for a in alone]


def test_each_request_keeps_its_own_options(loaded):
    model, processor = loaded
    engine = BatchEngine(model, processor, max_batch_size=4)
    inputs = prepared(loaded, "Hello there")
    plain = mlxvlm.generate(model, processor, "Hello there", max_tokens=30).text
    stop = plain[12:14]
    options = {
        "stopped": SamplingOptions(max_tokens=30, stop=[stop]),
        "seeded": SamplingOptions(max_tokens=12, temperature=1.0, seed=5),
        "penalised": SamplingOptions(max_tokens=12, repetition_penalty=2.0),
        "short": SamplingOptions(max_tokens=5),
    }
    results: dict[str, list] = {name: [] for name in options}
    for name, option in options.items():
        engine.submit(inputs, option, results[name].append)
    run_to_end(engine)
    assert engine.stats.peak_batch_size == 4
    assert [s.generation_tokens for s in results["short"]] == [1, 2, 3, 4, 5]
    assert results["short"][-1].finish_reason == "length"
    alone = mlxvlm.generate(model, processor, "Hello there", max_tokens=12,
                            repetition_penalty=2.0)
    assert [s.token for s in results["penalised"]] == alone.tokens
    stopped = "".join(s.text for s in results["stopped"])
    assert results["stopped"][-1].finish_reason == "stop"
    assert stopped == plain[: plain.find(stop)]

    # A seeded request samples the same tokens whatever runs beside it.
    again: list = []
    solo = BatchEngine(model, processor)
    solo.submit(inputs, options["seeded"], again.append)
    run_to_end(solo)
    assert [s.token for s in again] == [s.token for s in results["seeded"]]


def test_cancelled_requests_leave_at_every_stage(loaded):
    model, processor = loaded
    engine = BatchEngine(model, processor, max_batch_size=1, prefill_step_size=8)
    got = {name: [] for name in ("decoding", "prefilling", "queued")}
    long_prompt = prepared(loaded, " ".join(PROMPTS))
    handles = {
        name: engine.submit(long_prompt if name == "prefilling" else prepared(loaded, "Hello"),
                            SamplingOptions(max_tokens=500), got[name].append)
        for name in got
    }
    # "decoding" is admitted (prefilled 8 tokens per step) and decodes; the others wait.
    for _ in range(100):
        engine.step()
        if len(got["decoding"]) >= 3:
            break
    assert not got["prefilling"] and engine.stats.waiting == 2
    handles["queued"].cancel()
    engine.step()
    assert engine.stats.waiting == 1
    decoded = len(got["decoding"])
    handles["decoding"].cancel()
    engine.step()
    assert len(got["decoding"]) == decoded  # nothing more after the cancel...
    assert engine.stats.active == 1  # ...and its slot went to the next request at once
    engine.step()  # one more prefill chunk of the long prompt
    handles["prefilling"].cancel()
    engine.step()
    assert not engine.has_work
    assert not got["prefilling"] and not got["queued"]
    assert engine.stats.requests_cancelled == 3


def test_prompt_longer_than_the_context_is_refused_at_submit(loaded):
    model, processor = loaded
    engine = BatchEngine(model, processor)
    too_long = prepared(loaded, "garden " * 1100)
    with pytest.raises(PromptTooLongError, match=rf"{too_long.num_tokens} tokens.*1024 tokens"):
        engine.submit(too_long, SamplingOptions(), lambda _: None)
    with pytest.raises(MlxvlmError, match="top_p"):
        engine.submit(prepared(loaded, "Hi"), SamplingOptions(top_p=0), lambda _: None)


def test_prompt_keys_tell_images_apart():
    image_token, a, b = 9, image_hash(make_image(8, 8, 1)), image_hash(make_image(8, 8, 2))
    assert a != b and a == image_hash(make_image(8, 8, 1))
    ids = np.array([1, 2, image_token, image_token, 3, image_token, image_token, 4])
    key_ab = prompt_key(ids, [image_token], [a, b])
    key_aa = prompt_key(ids, [image_token], [a, a])
    assert (key_ab[:2] == ids[:2]).all() and (key_ab[2:] < 0)[[0, 1, 3, 4]].all()
    # The first image is keyed the same; the runs of the second differ.
    assert (key_ab[:5] == key_aa[:5]).all() and (key_ab[5:7] != key_aa[5:7]).all()
    # Placeholders merged into one run (fewer runs than images) depend on all images.
    merged = np.array([1, image_token, image_token, 2])
    assert (prompt_key(merged, [image_token], [a, b])[1:3]
            != prompt_key(merged, [image_token], [a, a])[1:3]).all()


def test_prefix_cache_reuses_a_conversation(loaded):
    model, processor = loaded
    engine = BatchEngine(model, processor, prefix_cache=PrefixCache(max_entries=2))
    image = make_image(64, 64, 7)
    first = prepared(loaded, "Describe this image.", [image])
    steps: list = []
    engine.submit(first, SamplingOptions(max_tokens=8), steps.append,
                  image_hashes=[image_hash(image)])
    run_to_end(engine)
    assert len(engine.prefix_cache) == 1
    # The same prompt with another image of the same size shares only the text before it.
    other = make_image(64, 64, 8)
    again: list = []
    engine.submit(prepared(loaded, "Describe this image.", [other]), SamplingOptions(max_tokens=8),
                  again.append, image_hashes=[image_hash(other)])
    run_to_end(engine)
    first_placeholder = int(np.flatnonzero(np.isin(np.asarray(first.input_ids[0]),
                                                   list(model.placeholder_token_ids)))[0])
    assert again[0].cached_tokens == first_placeholder
