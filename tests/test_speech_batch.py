"""Talkers stepped together (``speech.speech_batch.SpeechBatch``, as the batching engine
drives it: ``join``, ``heard`` after each thinker token, ``step`` while any is ready,
``leave``) speak the codes and waveforms each speaks alone (``speech.pipeline.speak``
over the same recorded thinker states, itself tested against transformers), on the tiny
speaking Qwen3-Omni (the session's, tests/conftest.py) and a tiny Qwen2.5-Omni:

- speakers joining at different steps (each step of the engine one token heard, then
  one batch step), with other voices, greedy or seeded sampling, one
  hearing its thinker's tokens at a third of the others' pace so that its row waits for
  text while the others step (Qwen3-Omni's talker follows the thinker), the passes
  holding several rows at once;
- one speaker cancelled mid-way (its row freed, the others' codes unchanged, its own
  codes so far its alone codes' start), and one whose codec fails (the failure its
  own);
- the batch's rows and talkers freed once every speaker has left;
- ``TalkerRows`` on its own: rows joining shorter and longer than the batch so far, rows
  left out of passes, a row leaving and the rest fed in another order each attend as
  they would over their own mlx-lm ``KVCache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

import mlxvlm
from mlxvlm.generate.speech import thinker_states
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.speech import pipeline
from mlxvlm.speech.speech_batch import SpeechBatch
from mlxvlm.speech.talker_rows import TalkerRows

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

THINKER_TOKENS = 10
FRAMES = 16
PROMPTS = ("Describe a red circle.", "Tell me about squares.", "Hello there, voice.")


@pytest.fixture(scope="module")
def qwen3(speaking_checkpoint):
    return mlxvlm.load(speaking_checkpoint)


@pytest.fixture(scope="module")
def qwen2_5(speaking_qwen2_5_checkpoint):
    return mlxvlm.load(speaking_qwen2_5_checkpoint)


@dataclass
class Answer:
    tap: object
    prompt_tokens: int
    tokens: list[int]


def answers(loaded) -> list[Answer]:
    """Each prompt's answer, written with the thinker's states recorded."""
    model, processor = loaded
    written = []
    for prompt in PROMPTS:
        with thinker_states(model) as tap:
            text = mlxvlm.generate(model, processor, prompt, max_tokens=THINKER_TOKENS)
        written.append(Answer(tap, text.prompt_tokens, text.tokens))
    return written


@dataclass
class Plan:
    answer: Answer
    options: dict
    joins: int = 0  # the engine step it joins at
    every: int = 1  # it hears a token every `every` steps
    leaves: int | None = None  # the engine step it is cancelled at
    fails_at_frame: int | None = None  # its codec raises on this frame


@dataclass
class Outcome:
    speaker: pipeline.AnswerSpeaker
    chunks: list[np.ndarray] = field(default_factory=list)
    speech: pipeline.Speech | None = None
    failure: BaseException | None = None


class CodecFailure(RuntimeError):
    pass


def alone(loaded, plan: Plan) -> pipeline.Speech:
    model, processor = loaded
    answer = plan.answer
    return pipeline.speak(model, answer.tap, answer.prompt_tokens, answer.tokens,
                          eos_token_ids(processor), max_frames=FRAMES, **plan.options)


def failing_codec(speaker: pipeline.AnswerSpeaker, frame: int) -> None:
    push = speaker.codec.push

    def push_or_fail(codes):
        if len(speaker.frames) == frame:
            raise CodecFailure("the codec broke")
        return push(codes)

    speaker.codec.push = push_or_fail


def together(loaded, plans: list[Plan], passes: list | None = None) -> list[Outcome]:
    """The plans driven through one SpeechBatch as the engine drives it: each engine
    step, every joined speaker hears its next token (on its pace), then the batch steps
    once if any talker is ready. ``passes``: (rows, rows fed) of each talker pass."""
    model, processor = loaded
    eos = eos_token_ids(processor)
    batch = SpeechBatch()
    outcomes = []
    for plan in plans:
        answer = plan.answer
        speaker = pipeline.AnswerSpeaker(model, answer.tap, answer.prompt_tokens, eos,
                                         max_frames=FRAMES, **plan.options)
        if plan.fails_at_frame is not None:
            failing_codec(speaker, plan.fails_at_frame)
        outcomes.append(Outcome(speaker))
    heard = [0] * len(plans)
    forward = TalkerRows.forward

    def counted(rows, call, inputs, positions, fed):
        passes.append((len(rows), len(fed)))
        return forward(rows, call, inputs, positions, fed)

    TalkerRows.forward = counted if passes is not None else forward
    try:
        for step in range(200):
            for key, (plan, outcome) in enumerate(zip(plans, outcomes)):
                if step == plan.joins:
                    batch.join(key, outcome.speaker)
                if step == plan.leaves and key in batch:
                    batch.leave(key)
                if key not in batch or (step - plan.joins) % plan.every:
                    continue
                tokens = plan.answer.tokens
                if heard[key] < len(tokens):
                    heard[key] += 1
                    assert batch.heard(key, tokens[heard[key] - 1], heard[key] == len(tokens)) is None
            if batch.ready():
                for key, spoken in batch.step().items():
                    outcome = outcomes[key]
                    outcome.chunks.extend(spoken.chunks)
                    outcome.speech = spoken.speech or outcome.speech
                    outcome.failure = spoken.failure or outcome.failure
            if step > max(plan.joins for plan in plans) and not len(batch):
                break
    finally:
        TalkerRows.forward = forward
    assert not len(batch) and not batch.talkers  # every row freed
    return outcomes


def assert_spoke_alone(outcome: Outcome, one_shot: pipeline.Speech) -> None:
    assert outcome.failure is None and outcome.speech is not None
    np.testing.assert_array_equal(outcome.speech.codes, one_shot.codes)
    np.testing.assert_array_equal(np.concatenate(outcome.chunks), one_shot.audio)
    np.testing.assert_array_equal(outcome.speech.audio, one_shot.audio)


# ------------------------------------------------------------------------------ Qwen3-Omni


@pytest.fixture(scope="module")
def qwen3_answers(qwen3):
    return answers(qwen3)


SAMPLING = {
    "greedy": [dict(talker_temperature=0), dict(talker_temperature=0, voice="chelsie"),
               dict(talker_temperature=0)],
    "seeded": [dict(seed=3), dict(seed=4, talker_temperature=0.7, voice="aiden"),
               dict(seed=5)],
}


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_qwen3_omni_talkers_stepped_together_speak_as_each_alone(qwen3, qwen3_answers,
                                                                 sampling):
    first, second, third = SAMPLING[sampling]
    plans = [Plan(qwen3_answers[0], first), Plan(qwen3_answers[1], second, joins=2),
             Plan(qwen3_answers[2], third, joins=5, every=3)]
    passes = []
    outcomes = together(qwen3, plans, passes)
    for plan, outcome in zip(plans, outcomes):
        one_shot = alone(qwen3, plan)
        assert len(one_shot.codes) > 4
        assert_spoke_alone(outcome, one_shot)
    # rows stepped at once, and passes where a row waited for text while others stepped
    assert max(rows for rows, _ in passes) == 3
    assert any(fed == 2 for rows, fed in passes if rows == 3)
    assert any(fed == 1 for rows, fed in passes if rows == 3)


def test_a_cancelled_or_failing_speaker_leaves_the_others_speaking_as_alone(qwen3, qwen3_answers):
    greedy = dict(talker_temperature=0)
    plans = [Plan(qwen3_answers[0], greedy), Plan(qwen3_answers[1], dict(seed=9), leaves=6),
             Plan(qwen3_answers[2], dict(greedy, voice="chelsie"), joins=1, fails_at_frame=5),
             Plan(qwen3_answers[1], greedy, joins=3, every=2)]
    outcomes = together(qwen3, plans)
    for index in (0, 3):
        assert_spoke_alone(outcomes[index], alone(qwen3, plans[index]))
    cancelled = outcomes[1]
    assert cancelled.speech is None and cancelled.failure is None
    spoken = np.stack(cancelled.speaker.frames)
    whole = alone(qwen3, plans[1]).codes
    assert 0 < len(spoken) < len(whole)
    np.testing.assert_array_equal(spoken, whole[:len(spoken)])
    assert cancelled.speaker.talker.finished and cancelled.speaker.talker.cache == []
    failed = outcomes[2]
    assert isinstance(failed.failure, CodecFailure) and failed.speech is None
    assert len(failed.speaker.frames) == 5 and failed.speaker.talker.cache == []


# ---------------------------------------------------------------------------- Qwen2.5-Omni


def test_qwen2_5_omni_talkers_stepped_together_speak_as_each_alone(qwen2_5):
    """Its talker follows the thinker too (one code a frame): speakers joining at other
    steps, one hearing a token every other step, one cancelled and one sampled from its
    seed, each speak as alone."""
    written = answers(qwen2_5)
    greedy = dict(talker_temperature=0)
    plans = [Plan(written[0], greedy), Plan(written[1], dict(greedy, voice="Ethan"), joins=3),
             Plan(written[2], greedy, joins=1, every=2, leaves=21),
             Plan(written[1], dict(seed=9), joins=2)]
    passes = []
    outcomes = together(qwen2_5, plans, passes)
    for index in (0, 1, 3):  # greedy, and sampled from its seed
        one_shot = alone(qwen2_5, plans[index])
        assert len(one_shot.codes) > 4
        assert_spoke_alone(outcomes[index], one_shot)
    cancelled = outcomes[2]
    spoken = np.stack(cancelled.speaker.frames)
    whole = alone(qwen2_5, plans[2]).codes
    assert 0 < len(spoken) < len(whole) and cancelled.speech is None
    np.testing.assert_array_equal(spoken, whole[:len(spoken)])
    assert max(rows for rows, _ in passes) == 4


# ------------------------------------------------------------------------------ the rows

HEADS, HEAD_DIM = 2, 8


def attention(inputs: mx.array, positions, cache) -> mx.array:
    """One attention layer whose queries, keys and values are its inputs (rows, 1,
    HEADS * HEAD_DIM), through the cache and mask a talker model uses."""
    x = inputs.reshape(inputs.shape[0], 1, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
    mask = create_attention_mask(inputs, cache[0])
    keys, values = cache[0].update_and_fetch(x, x)
    return mx.fast.scaled_dot_product_attention(x, keys, values, scale=HEAD_DIM ** -0.5,
                                                mask=mask).reshape(inputs.shape[0], -1)


def test_talker_rows_attend_as_each_row_over_its_own_cache():
    rng = np.random.default_rng(0)
    own: dict[str, list[KVCache]] = {}
    rows, order = TalkerRows(1), []

    def join(name: str, length: int) -> None:
        cache = [KVCache()]
        prompt = mx.array(rng.standard_normal((1, HEADS, length, HEAD_DIM)), mx.float32)
        cache[0].update_and_fetch(prompt, prompt)
        own[name] = cache
        rows.add(cache)
        order.append(name)

    def feed(names: list[str]) -> None:
        inputs = mx.array(rng.standard_normal((len(names), 1, HEADS * HEAD_DIM)), mx.float32)
        positions = mx.zeros((len(names), 3, 1), mx.int32)
        out = rows.forward(attention, inputs, positions, [order.index(n) for n in names])
        for i, name in enumerate(names):
            alone = attention(inputs[i:i + 1], None, own[name])
            np.testing.assert_allclose(np.array(out[i:i + 1]), np.array(alone), rtol=1e-5,
                                       atol=1e-6)

    join("a", 5)
    feed(["a"])
    join("b", 3)  # shorter than the batch: left padding
    feed(["a", "b"])
    feed(["b"])  # a waits
    join("c", 11)  # longer than the batch: the others move right
    assert rows.width == 11
    feed(["a", "c"])
    feed(["c", "b", "a"])
    rows.keep([order.index("c"), order.index("a")])  # b leaves
    order[:] = ["c", "a"]
    assert len(rows) == 2 and rows.width == 13  # c's columns from its first
    feed(["a", "c"])
    rows.keep([1])
    order[:] = ["a"]
    assert rows.width == 11  # from a's first column (moved right by 3 as c joined) on
    feed(["a"])
    rows.keep([])
    assert len(rows) == 0 and rows.width == 0 and rows.layers[0].keys is None
