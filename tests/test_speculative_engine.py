"""Speculative decoding in the batching engine (the server with ``--draft-model`` or
``--prompt-lookup-num-tokens`` or ``--mtp``) with ``max_batch_size`` 1 -- one sequence on
its own cache (above, ``test_batched_speculation.py``): the same greedy tokens as the
engine without it and as ``generate``, a next turn that reuses the speculative answer's
cache from the prefix cache, cancellation, and the server's rule for its flags."""

from __future__ import annotations

from engine_helpers import run_to_end

import pytest

import mlxvlm
from mlxvlm.batching import BatchEngine, SamplingOptions
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.speculative import Speculation
from mlxvlm.batching.prefix_cache import PrefixCache, image_hash
from mlxvlm.prompt import prepare_inputs
from mlxvlm.server.config import ServerConfig
from parity import user
from tiny import make_image

IMAGE = make_image(112, 84, seed=1)
NEW = 24



def answer(engine, loaded, messages, max_tokens=NEW):
    model, processor = loaded
    inputs = prepare_inputs(processor, messages, [IMAGE], feature_names=model.feature_names)
    steps: list = []
    engine.submit(inputs, SamplingOptions(max_tokens=max_tokens), steps.append,
                  image_hashes=[image_hash(IMAGE)])
    run_to_end(engine)
    return steps


@pytest.mark.parametrize("family, kind", [
    (family, kind) for family in ("qwen2_vl", "qwen3_5") for kind in ("self-draft", "prompt lookup")
] + [("qwen3_5", "mtp")])
def test_the_engine_speculates_with_the_same_tokens_and_reuses_the_answer(
        tiny_checkpoints, family, kind):
    loaded = mlxvlm.load(tiny_checkpoints.path(family, "hub"))
    model, processor = loaded
    speculation = {"self-draft": Speculation(draft_model=model, num_draft_tokens=3),
                   "prompt lookup": Speculation(prompt_lookup_num_tokens=3),
                   # chunked prefill watched, then a next turn's head from the reused prefix
                   "mtp": Speculation(mtp=True, num_draft_tokens=3)}[kind]
    first_messages = user(None, "Describe this image.")
    runs = {}
    for name, spec in (("plain", None), ("speculative", speculation)):
        engine = BatchEngine(model, processor, max_batch_size=1, prefix_cache=PrefixCache(),
                             prefill_step_size=16, speculation=spec)
        first = answer(engine, loaded, first_messages, max_tokens=8)
        text = "".join(step.text for step in first)
        messages = [*first_messages, {"role": "assistant", "content": text},
                    *user("What colours are in it?")]
        second = answer(engine, loaded, messages)
        runs[name] = ([s.token for s in first], [s.token for s in second],
                      second[0].cached_tokens, messages, engine.stats.drafted_tokens)
    plain, speculative = runs["plain"], runs["speculative"]
    assert speculative[:3] == plain[:3]
    assert plain[4] == 0 and speculative[4] > 0  # it drafted
    assert speculative[2] > 0  # the next turn reused the speculative answer's cache
    fresh = mlxvlm.generate(model, processor, plain[3], image=[IMAGE], max_tokens=NEW)
    assert speculative[1] == fresh.tokens


def test_a_cancelled_speculating_request_frees_the_engine(tiny_checkpoints):
    loaded = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))
    model, processor = loaded
    engine = BatchEngine(model, processor, max_batch_size=1,
                         speculation=Speculation(draft_model=model))
    inputs = prepare_inputs(processor, user(None, "Describe this image."), [IMAGE],
                            feature_names=model.feature_names)
    steps: list = []
    handle = engine.submit(inputs, SamplingOptions(max_tokens=NEW), steps.append)
    for _ in range(200):
        engine.step()
        if len(steps) >= 3:
            handle.cancel()
            break
    run_to_end(engine)
    assert 3 <= len(steps) < NEW and steps[-1].finish_reason is None
    assert engine.stats.requests_cancelled == 1 and engine.stats.active == 0
    assert [s.token for s in answer(engine, loaded, user(None, "Describe this image."))] == (
        mlxvlm.generate(model, processor, user(None, "Describe this image."), image=[IMAGE],
                        max_tokens=NEW).tokens)


def test_the_server_takes_one_drafter_with_any_concurrency():
    with pytest.raises(MlxvlmError, match="not both"):
        ServerConfig(model_id="m", max_concurrency=1, draft_model="d", prompt_lookup_num_tokens=2)
    ServerConfig(model_id="m", max_concurrency=1, prompt_lookup_num_tokens=2)
    ServerConfig(model_id="m", max_concurrency=8, prompt_lookup_num_tokens=2)
