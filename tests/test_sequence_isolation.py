"""One sequence's failure in a batched decode step ends that sequence alone (issue 39, item
2): its logits processor raising, or its scores turning to NaN (or ruling out every
token), is delivered to its own request, while the others in the same steps produce
exactly what they produce alone. The batching engine stepped by hand on the tiny
Qwen2-VL; the server's side is tests/test_server_hostile_grammars.py."""

from __future__ import annotations

from engine_helpers import run_to_end

import mlx.core as mx
import numpy as np
import pytest

import mlxvlm
from mlxvlm.batching import BatchEngine, BatchStep, SamplingOptions, SequenceFault
from mlxvlm.prompt import prepare_inputs

BYSTANDERS = ["Describe this image.", "The quick brown fox", "Hello there"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))


def inputs_of(loaded, text):
    model, processor = loaded
    return prepare_inputs(processor, [{"role": "user", "content": text}],
                          feature_names=model.feature_names)


class FailsAt:
    """A per-sequence processor that does ``what`` to the logits at its ``at``-th call
    (the first call is the prompt's last position)."""

    def __init__(self, at: int, what):
        self.at, self.what = at, what

    def processor(self, max_tokens):
        calls = []

        def process(history, logits):
            calls.append(None)
            return self.what(logits) if len(calls) == self.at else logits
        return process


def nan_scores(logits):
    return logits * mx.array(float("nan"))


def nothing_allowed(logits):
    return mx.full(logits.shape, -float("inf"), dtype=logits.dtype)


def raising(logits):
    raise RuntimeError("this row's processor broke")


def run(loaded, requests):
    """Each (text, options) through one engine, all submitted before the first step; what
    each got: its tokens, and the error that ended it (or None)."""
    model, processor = loaded
    engine = BatchEngine(model, processor, max_batch_size=len(requests))
    results = []
    for text, options in requests:
        got = {"tokens": [], "error": None}

        def deliver(item, got=got):
            if isinstance(item, BatchStep):
                got["tokens"].append(item.token)
            else:
                got["error"] = item
        engine.submit(inputs_of(loaded, text), options, deliver)
        results.append(got)
    run_to_end(engine)
    return engine, results


@pytest.fixture(scope="module")
def alone(loaded):
    return [run(loaded, [(text, SamplingOptions(max_tokens=MAX_TOKENS))])[1][0]["tokens"]
            for text in BYSTANDERS]


@pytest.mark.parametrize("what, error", [(nan_scores, SequenceFault),
                                         (nothing_allowed, SequenceFault),
                                         (raising, RuntimeError)])
def test_a_failing_row_ends_alone_and_the_batch_goes_on(loaded, alone, what, error):
    # The failure comes at the fourth token, when all rows decode together.
    hostile = SamplingOptions(max_tokens=MAX_TOKENS, extra_processors=(FailsAt(4, what),))
    requests = [(text, SamplingOptions(max_tokens=MAX_TOKENS)) for text in BYSTANDERS]
    requests.insert(1, ("What is in the picture?", hostile))
    engine, results = run(loaded, requests)
    failed = results.pop(1)
    assert isinstance(failed["error"], error)
    assert len(failed["tokens"]) == 3  # the tokens before the failing step, delivered
    assert [r["tokens"] for r in results] == alone
    assert all(r["error"] is None for r in results)
    assert engine.stats.requests_failed == 1
    assert engine.stats.peak_batch_size == len(requests)


def test_a_row_failing_at_its_first_token_ends_alone(loaded, alone):
    # The first token comes from the prompt's last chunk, before the row joins the batch.
    hostile = SamplingOptions(max_tokens=MAX_TOKENS,
                              extra_processors=(FailsAt(1, nothing_allowed),))
    requests = [(text, SamplingOptions(max_tokens=MAX_TOKENS)) for text in BYSTANDERS]
    _, results = run(loaded, requests + [("Hello", hostile)])
    assert isinstance(results[-1]["error"], SequenceFault) and not results[-1]["tokens"]
    assert [r["tokens"] for r in results[:-1]] == alone


def test_sampled_sanely_tells_nan_and_empty_rows_apart_from_sound_ones():
    from mlxvlm.sampling import RowSampler, sampled_sanely, sampling_step

    logits = mx.array(np.random.default_rng(0).normal(size=(3, 10)).astype(np.float32))
    logits[1] = float("nan")
    logits[2] = -float("inf")
    rows = [RowSampler(SamplingOptions(), mx.array([1])) for _ in range(3)]
    tokens, logprobs = sampling_step(logits, rows)
    assert sampled_sanely(tokens, logprobs).tolist() == [True, False, False]
