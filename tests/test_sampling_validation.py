"""Sampling values: where the ones left out come from (the checkpoint's
generation_config.json, then the entry point's defaults), the one set of valid ranges,
and the sampler's guards (a temperature too small to divide by, a top_k above the
vocabulary). The server cases send each bad value and expect a 400 in OpenAI's error
shape naming the field, and a server that keeps serving."""

from __future__ import annotations

import json
import math
import shutil

import httpx
import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler
from server_harness import MODEL_ID, LiveServer

import mlxvlm
from mlxvlm.batching import SamplingOptions, batch_generate
from mlxvlm.errors import MlxvlmError
from mlxvlm.sampling.ranges import SAMPLING, Range
from mlxvlm.sampling import GREEDY_BELOW, build_sampler
from mlxvlm.sampling.defaults import (
    GENERATION_CONFIG,
    OPENAI_DEFAULTS,
    checkpoint_defaults_from,
    resolve,
)

PROMPT = "Describe the weather in three words."


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints.path("qwen2_vl", "hub")


def with_generation_config(checkpoint, tmp_path, **fields):
    """A copy of ``checkpoint`` whose generation_config.json also sets ``fields``."""
    copy = tmp_path / "model"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / GENERATION_CONFIG).read_text())
    (copy / GENERATION_CONFIG).write_text(json.dumps({**config, **fields}))
    return copy


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return mlxvlm.load(checkpoint)


@pytest.fixture(scope="module")
def greedy_loaded(checkpoint, tmp_path_factory):
    """The same model with a generation_config.json that asks for greedy decoding while
    naming sampling values (as many checkpoints do)."""
    path = with_generation_config(checkpoint, tmp_path_factory.mktemp("greedy"),
                                  do_sample=False, temperature=0.9, top_p=0.5)
    return mlxvlm.load(path)


# -- generation_config.json -> defaults ----------------------------------------------


def test_checkpoint_values_are_read_and_bad_ones_ignored():
    defaults = checkpoint_defaults_from(
        {"temperature": 0.7, "top_k": 20, "top_p": 7.0, "min_p": "x", "repetition_penalty": 1.0}
    )
    assert defaults.values == {"temperature": 0.7, "top_k": 20, "repetition_penalty": None}
    assert defaults.ignored == ("top_p=7.0", "min_p='x'")


def test_do_sample_false_is_greedy_whatever_the_temperature():
    defaults = checkpoint_defaults_from(
        {"do_sample": False, "temperature": 0.9, "top_k": 5, "repetition_penalty": 1.1})
    assert defaults.values == {"temperature": 0.0, "repetition_penalty": 1.1}
    assert "do_sample false" in defaults.source


def test_given_values_win_then_the_checkpoint_then_the_fallback():
    checkpoint = checkpoint_defaults_from({"temperature": 0.6, "top_p": 0.9})
    chosen = resolve({"temperature": 0.2, "top_p": None}, checkpoint, OPENAI_DEFAULTS, "OpenAI")
    assert chosen.values == {**OPENAI_DEFAULTS, "temperature": 0.2, "top_p": 0.9}
    assert chosen.sources["temperature"] == "given"
    assert chosen.sources["top_p"] == GENERATION_CONFIG
    assert chosen.sources["top_k"] == "OpenAI"
    assert "top_p 0.9 (generation_config.json)" in chosen.describe()


def test_load_keeps_the_checkpoint_defaults_on_the_processor(greedy_loaded, loaded):
    assert greedy_loaded[1].sampling_defaults.values == {"temperature": 0.0}
    assert loaded[1].sampling_defaults.values == {}


def test_the_api_uses_the_checkpoint_defaults_for_what_is_left_out(greedy_loaded, loaded):
    model, processor = greedy_loaded
    left_out = mlxvlm.generate(model, processor, PROMPT, max_tokens=10, seed=1)
    # The same weights without the greedy config, decoding greedily by hand.
    explicit = mlxvlm.generate(*loaded, PROMPT, max_tokens=10, temperature=0.0)
    assert left_out.tokens == explicit.tokens
    # A value given by the caller still wins over the checkpoint's.
    hot = [mlxvlm.generate(model, processor, PROMPT, max_tokens=10, temperature=2.0,
                           seed=s).tokens for s in (1, 2, 3)]
    assert any(tokens != explicit.tokens for tokens in hot)


def test_batch_generate_uses_the_checkpoint_defaults(greedy_loaded, loaded):
    model, processor = greedy_loaded
    [left_out] = batch_generate(model, processor, [PROMPT], max_tokens=10)
    [explicit] = batch_generate(*loaded, [PROMPT], max_tokens=10, temperature=0.0)
    assert left_out.tokens == explicit.tokens


def test_a_sampling_checkpoint_default_is_applied_like_the_given_value(checkpoint, tmp_path):
    model, processor = mlxvlm.load(
        with_generation_config(checkpoint, tmp_path, temperature=1.5, top_k=7))
    left_out = mlxvlm.generate(model, processor, PROMPT, max_tokens=10, seed=4)
    given = mlxvlm.generate(model, processor, PROMPT, max_tokens=10, seed=4,
                            temperature=1.5, top_k=7)
    greedy = mlxvlm.generate(model, processor, PROMPT, max_tokens=10, temperature=0.0)
    assert left_out.tokens == given.tokens != greedy.tokens


@pytest.mark.parametrize("options", [
    {"temperature": -1.0}, {"top_p": 5.0}, {"top_k": -5}, {"min_p": 2.0},
    {"temperature": math.nan}, {"repetition_penalty": 0.0}, {"seed": 2**70},
])
def test_the_api_refuses_values_outside_the_ranges(loaded, options):
    with pytest.raises(MlxvlmError, match=next(iter(options))):
        mlxvlm.generate(*loaded, PROMPT, max_tokens=2, **options)
    with pytest.raises(MlxvlmError, match=next(iter(options))):
        batch_generate(*loaded, [PROMPT], max_tokens=2, **options)


def test_batch_generate_names_unknown_options(loaded):
    with pytest.raises(MlxvlmError, match="temprature"):
        batch_generate(*loaded, [PROMPT], temprature=0.5)


# -- the sampler's guards ------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-300, 1e-30, GREEDY_BELOW / 2, 0.0])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    sampler = build_sampler(temperature, top_p=0.9, top_k=3)
    # mlx-lm's one greedy sampler, so that the batching engine groups these rows.
    assert sampler is make_sampler(temp=0.0)
    logprobs = mx.log(mx.softmax(mx.array([[0.1, 3.0, 0.2, 2.9]]), axis=-1))
    assert sampler(logprobs).tolist() == [1]


def test_mlx_lm_alone_samples_noise_at_such_a_temperature():
    # Why the guard exists: 1/T overflows float32, and every token becomes equally likely.
    logprobs = mx.log(mx.softmax(mx.array([[0.0, 8.0, 0.0, 0.0]]), axis=-1))
    mx.random.seed(0)
    picks = {make_sampler(temp=1e-300)(logprobs).item() for _ in range(40)}
    assert picks != {1}


@pytest.mark.parametrize("top_k", [4, 5, 10**6, 2**31 - 1])
def test_top_k_at_or_above_the_vocabulary_keeps_every_token(top_k):
    logprobs = mx.log(mx.softmax(mx.array([[0.0, 1.0, 2.0, 3.0]]), axis=-1))
    mx.random.seed(7)
    bounded = [build_sampler(1.0, top_k=top_k)(logprobs).item() for _ in range(20)]
    mx.random.seed(7)
    unfiltered = [build_sampler(1.0)(logprobs).item() for _ in range(20)]
    assert bounded == unfiltered


def test_top_k_below_the_vocabulary_still_filters():
    logprobs = mx.log(mx.softmax(mx.array([[0.0, 1.0, 2.0, 3.0]]), axis=-1))
    sampler = build_sampler(2.0, top_k=2)
    assert {sampler(logprobs).item() for _ in range(40)} <= {2, 3}


def test_sampling_options_check_the_shared_ranges():
    SamplingOptions(temperature=1e-300, top_k=2**31 - 1, seed=-(2**63)).validate()
    for bad in ({"top_k": 2**70}, {"seed": 2**64}, {"logit_bias": {-1: 1.0}},
                {"logit_bias": {3: math.inf}}, {"presence_penalty": 2.5}, {"max_tokens": 0}):
        with pytest.raises(MlxvlmError):
            SamplingOptions(**bad).validate()


def test_a_range_refuses_bools_nan_and_the_wrong_kind():
    valid = Range(int, 0, 10)
    assert valid.problem(True) and valid.problem(1.0) and valid.problem(11)
    assert Range(float, 0, 2).problem(math.inf) and SAMPLING["top_p"].problem(0.0)
    assert valid.problem(10) is None and SAMPLING["top_p"].problem(1) is None


# -- the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(*loaded) as live:
        yield live


def post(server, body: dict | str) -> httpx.Response:
    # Python's json writes NaN and Infinity, as some clients do.
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.base_url}/v1/chat/completions", content=content,
                      headers={"Content-Type": "application/json"}, timeout=60)


def request(**fields) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 4, **fields}


BAD_FIELDS = [
    ({"top_k": 2**70}, "top_k"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"logit_bias": {"²": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {" 3": 1}}, "logit_bias"),
    ({"logit_bias": {"3 ": 1}}, "logit_bias"),
    ({"logit_bias": {"0x10": 1}}, "logit_bias"),
    ({"logit_bias": {"": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"1": math.nan}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"n": 2**70}, "n"),
    ({"n": 0}, "n"),
    ({"n": 2}, "n"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 2**70}, "max_completion_tokens"),
    ({"seed": 2**70}, "seed"),
    ({"seed": -(2**64)}, "seed"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -math.inf}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -math.inf}, "min_p"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("fields, param", BAD_FIELDS, ids=[p + str(i) for i, (_, p) in
                                                            enumerate(BAD_FIELDS)])
def test_a_bad_sampling_field_is_a_400_naming_it(server, fields, param):
    response = post(server, request(**fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param in error["message"]
    assert len(error["message"]) < 300  # a 5000-digit key is not echoed whole
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_a_number_beyond_float_range_in_the_json_is_a_400(server):
    body = json.dumps(request()).replace('"max_tokens": 4', '"max_tokens": 4, "top_p": 1e400')
    response = post(server, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_p"


def test_the_server_answers_after_every_bad_request(server):
    response = post(server, request(temperature=0))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_tiny_temperature_answers_as_greedy(server):
    tiny = post(server, request(temperature=1e-300, max_tokens=8))
    greedy = post(server, request(temperature=0, max_tokens=8))
    assert tiny.status_code == greedy.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


def test_top_k_above_the_vocabulary_is_no_filter(server):
    bounded = post(server, request(temperature=1.5, top_k=2**31 - 1, seed=5, max_tokens=8))
    unfiltered = post(server, request(temperature=1.5, seed=5, max_tokens=8))
    assert bounded.status_code == unfiltered.status_code == 200, bounded.text
    assert bounded.json()["choices"][0]["message"] == unfiltered.json()["choices"][0]["message"]


def test_a_large_seed_within_int64_is_served(server):
    response = post(server, request(temperature=1.0, seed=-(2**63), max_tokens=3))
    assert response.status_code == 200, response.text


def test_a_request_without_sampling_fields_gets_the_checkpoint_defaults(greedy_loaded, loaded):
    with LiveServer(*greedy_loaded) as live:
        left_out = post(live, request(max_tokens=8))
    with LiveServer(*loaded) as live:
        greedy = post(live, request(max_tokens=8, temperature=0))
    assert left_out.status_code == greedy.status_code == 200, left_out.text
    assert left_out.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]

