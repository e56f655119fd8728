"""One sampling step for every path: the single loop (``generate``) and the batching
engine (``batch_generate``, the server) give the same tokens and log-probabilities with
penalties, logit bias and top logprobs, and the same tokens for a seed; the step itself
applies each row's own processors and seeds."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxvlm
from mlxvlm import batch_generate, generate
from mlxvlm.sampling import RowSampler, SamplingOptions, sampling_step, token_logprobs

PROMPTS = ["Describe the weather in three words.", "Hello there", "The quick brown fox"]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))


def test_penalties_bias_and_logprobs_are_the_same_alone_and_batched(loaded):
    model, processor = loaded
    plain = generate(model, processor, PROMPTS[0], max_tokens=16)
    options = dict(max_tokens=16, presence_penalty=1.5, frequency_penalty=0.7,
                   logit_bias={plain.tokens[2]: -100.0, 17: 4.0}, top_logprobs=3)
    alone = [generate(model, processor, p, **options) for p in PROMPTS]
    together = batch_generate(model, processor, PROMPTS, max_batch_size=3, **options)
    # The options take effect in the single path: the banned token never comes.
    assert alone[0].tokens != plain.tokens
    assert plain.tokens[2] not in alone[0].tokens
    for one, batched in zip(alone, together):
        assert batched.tokens == one.tokens
        assert batched.text == one.text
        assert len(one.logprobs) == len(one.tokens) == len(one.top_logprobs)
        np.testing.assert_allclose(batched.logprobs, one.logprobs, atol=1e-4)
        assert [[t for t, _ in top] for top in batched.top_logprobs] == [
            [t for t, _ in top] for top in one.top_logprobs]
        # Greedy: the chosen token is the most likely one.
        assert [top[0][0] for top in one.top_logprobs] == one.tokens


def test_stream_generate_reports_logprobs_as_the_engine_does(loaded):
    model, processor = loaded
    results = list(mlxvlm.stream_generate(model, processor, PROMPTS[1], max_tokens=4,
                                          top_logprobs=0))
    assert all(r.logprob is not None and r.top_logprobs is None for r in results)
    assert results[0].logprob == pytest.approx(float(results[0].logprobs[results[0].token]))
    assert all(r.logprob is None for r in
               mlxvlm.stream_generate(model, processor, PROMPTS[1], max_tokens=2))


def test_a_seed_samples_the_same_tokens_alone_and_in_a_batch(loaded):
    model, processor = loaded
    options = dict(max_tokens=12, temperature=1.5, seed=11)
    alone = generate(model, processor, PROMPTS[0], **options)
    together = batch_generate(model, processor, PROMPTS, **options)
    assert together[0].tokens == alone.tokens
    assert alone.tokens != generate(model, processor, PROMPTS[0], max_tokens=12).tokens


def test_the_step_applies_each_rows_own_processors():
    logits = mx.array([[0.0, 1.0, 3.0, 2.0], [0.0, 1.0, 3.0, 2.0]])
    prompt = mx.array([1, 2])
    biased = RowSampler(SamplingOptions(logit_bias={0: 10.0}), prompt)
    plain = RowSampler(SamplingOptions(), prompt)
    tokens, logprobs = sampling_step(logits, [biased, plain])
    assert tokens.tolist() == [0, 2]
    assert mx.allclose(mx.logsumexp(logprobs, axis=-1), mx.zeros(2), atol=1e-6).item()
    # A fed token joins a row's history; a presence penalty then pushes it down.
    penalised = RowSampler(SamplingOptions(presence_penalty=2.0), prompt)
    tokens, _ = sampling_step(logits[:1], [penalised], fed=mx.array([2]))
    assert tokens.tolist() == [3]
    assert penalised.history.tolist() == [1, 2, 2] and penalised.sampled == 1


def test_a_seeded_row_draws_the_same_beside_any_other_row():
    logits = mx.log(mx.softmax(mx.array([[0.5, 0.4, 0.3, 0.2, 0.1] * 4]), axis=-1))
    def draws(rows):
        out = []
        for _ in range(12):
            tokens, _ = sampling_step(mx.concatenate([logits] * len(rows)), rows)
            out.append(tokens.tolist()[0])
        return out
    seeded = SamplingOptions(temperature=1.0, seed=3)
    alone = draws([RowSampler(seeded, mx.array([1]))])
    beside = draws([RowSampler(seeded, mx.array([1])),
                    RowSampler(SamplingOptions(temperature=1.0), mx.array([1]))])
    assert alone == beside and len(set(alone)) > 1


def test_top_logprobs_are_ordered_most_likely_first():
    values = np.log(np.array([0.1, 0.4, 0.2, 0.3], dtype=np.float32))
    logprob, top = token_logprobs(values, 2, 3)
    assert logprob == pytest.approx(np.log(0.2))
    assert [t for t, _ in top] == [1, 3, 2]
    assert token_logprobs(values, 2, 0) == (pytest.approx(np.log(0.2)), None)
