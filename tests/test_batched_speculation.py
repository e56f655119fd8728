"""Speculation under continuous batching (issue 42): the speculating requests of a batch
share one verify pass, each row keeping its own accepted count. Greedy requests answer
exactly as each answers alone with plain decoding -- for prompt lookup, a draft model that
is the target itself (every draft accepted), another random model (drafts rejected), the
MTP head, and a drafter that is right for a different number of tokens in every row and
pass (the rows' caches realigned each pass) -- on a plain decoder (Qwen2-VL), a hybrid
one whose recurrent states are rewound per row (Qwen3.5) and LFM2-VL's convolution
states; Gemma 3's sliding windows decode without speculation. A draft model drafts for
all rows at once as it drafts for each alone. Sampled rows draw what the same
seed draws in single-sequence speculation; grammar rows decode plainly beside them;
logprobs, stop strings, cancellation, a row's own failure and the prefix cache keep their
behaviour. The server's side, through the entry point, is at the end."""

from __future__ import annotations

from dataclasses import dataclass

from engine_helpers import run_to_end

import pytest

import mlxvlm
from mlxvlm.batching import BatchEngine, BatchStep, SamplingOptions, SequenceFault
from mlxvlm.batching.prefix_cache import PrefixCache, image_hash
from mlxvlm.batching.speculation_rule import SpeculationRule
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.speculative import Speculation
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.prompt import prepare_inputs
from mlxvlm.sampling.constrained import json_schema_constraint
from parity import user
from tiny import TinyCheckpoints, make_image

IMAGES = [make_image(112, 84, seed=s) for s in (1, 2, 3, 4)]
TEXTS = ["Describe this image.", "What colours are in it? Describe this image in detail.",
         "Hi", "Describe the image, then describe it again."]
NEW = 20
PREFILL = 256  # one chunk per prompt: the requests join one step after another


@pytest.fixture(scope="module")
def other_checkpoints(tmp_path_factory):
    """The same tiny families with other random weights (and the same tokenizers)."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-other"), seed=3)


@pytest.fixture(scope="module")
def family_models(tiny_checkpoints, other_checkpoints):
    loaded = {}

    def get(family):
        if family not in loaded:
            target = mlxvlm.load(tiny_checkpoints.path(family, "hub"))
            other = mlxvlm.load(other_checkpoints.path(family, "hub"))[0]
            model, processor = target
            # The reference: each request alone, plain decoding.
            alone = [mlxvlm.generate(model, processor, user(None, text), image=[image],
                                     max_tokens=NEW).tokens
                     for text, image in zip(TEXTS, IMAGES)]
            loaded[family] = target, other, alone
        return loaded[family]

    return get


class OracleDrafter:
    """Drafts the reference answer's next tokens, right for a number of them that changes
    with the row and the pass, then wrong (the reference's token plus one)."""

    def __init__(self, answer: list[int], prompt_length: int, salt: int):
        self.answer, self.prompt_length, self.salt = answer, prompt_length, salt

    def propose(self, context, k):
        done = len(context) - self.prompt_length
        right = (done * 5 + self.salt) % (k + 1)
        upcoming = self.answer[done : done + k]
        drafts = upcoming[:right] + [t ^ 1 for t in upcoming[right:right + 1]]
        return drafts[:k], None

    def update(self, accepted, next_token):
        pass


@dataclass(frozen=True)
class OracleSpeculation(Speculation):
    answers: tuple = ()

    def drafter(self, model, inputs, options, prefill_step_size):
        prompt = inputs.input_ids[0].tolist()
        index = next(i for i, a in enumerate(self.answers) if a[0] == tuple(prompt))
        return OracleDrafter(list(self.answers[index][1]), len(prompt), salt=index)


def engine_of(loaded, speculation, rule=None, **options):
    """A batch of four that speculates at every step (``rule``: the steps that do)."""
    engine = BatchEngine(*loaded, max_batch_size=4, prefill_step_size=PREFILL,
                         speculation=speculation, **options)
    engine.speculation_rule = rule or SpeculationRule(adaptive=False)
    return engine


def inputs_of(loaded, text, image):
    model, processor = loaded
    return prepare_inputs(processor, user(None, text), [image], feature_names=model.feature_names)


def submit_all(engine, loaded, options, **submit):
    """Every prompt submitted before the first step; what each receives."""
    received = []
    for i, (text, image) in enumerate(zip(TEXTS, IMAGES)):
        got: list = []
        engine.submit(inputs_of(loaded, text, image), options[i], got.append, **submit)
        received.append(got)
    run_to_end(engine)
    return received


def tokens_of(received):
    return [[s.token for s in got if isinstance(s, BatchStep)] for got in received]


@pytest.mark.parametrize("family, kind", [
    ("qwen2_vl", "prompt lookup"), ("qwen2_vl", "self-draft"), ("qwen2_vl", "other model"),
    ("qwen2_vl", "oracle"), ("qwen3_5", "prompt lookup"), ("qwen3_5", "self-draft"),
    ("qwen3_5", "other model"), ("qwen3_5", "oracle"), ("qwen3_5", "mtp"),
    # LFM2's convolution states; Gemma 3's sliding windows (rotating caches, which cannot
    # give drafts back row by row) decode without speculation
    ("lfm2_vl", "oracle"), ("gemma3", "prompt lookup"),
])
def test_concurrent_greedy_requests_answer_as_each_alone(family_models, family, kind):
    loaded, other, alone = family_models(family)
    model, _ = loaded
    prompts = [tuple(inputs_of(loaded, t, i).input_ids[0].tolist()) for t, i in zip(TEXTS, IMAGES)]
    speculation = {
        "prompt lookup": Speculation(prompt_lookup_num_tokens=3),
        "self-draft": Speculation(draft_model=model, num_draft_tokens=3),
        "other model": Speculation(draft_model=other, num_draft_tokens=3),
        "oracle": OracleSpeculation(num_draft_tokens=4,
                                    answers=tuple(zip(prompts, map(tuple, alone)))),
        "mtp": Speculation(mtp=True, num_draft_tokens=3),
    }[kind]
    engine = engine_of(loaded, speculation)
    received = submit_all(engine, loaded, [SamplingOptions(max_tokens=NEW)] * 4)
    assert tokens_of(received) == alone
    stats = engine.stats
    assert stats.peak_batch_size >= 3 and stats.requests_finished == 4
    assert (stats.drafted_tokens > 0) == (family != "gemma3")
    if kind == "self-draft":
        assert stats.accepted_draft_tokens == stats.drafted_tokens
    if kind == "other model":
        assert stats.accepted_draft_tokens < stats.drafted_tokens / 4
    if kind == "oracle":
        assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens


@pytest.mark.parametrize("family, kind", [("qwen2_vl", "other model"), ("qwen3_5", "other model"),
                                          ("qwen3_5", "mtp")])
def test_sampled_rows_draw_what_their_seed_draws_alone(family_models, family, kind):
    """The acceptance rule per row, with the row's own generator: the draws of
    single-sequence speculation with the same seed (which keeps the target's
    distribution: tests/test_speculative.py)."""
    loaded, other, _ = family_models(family)
    model, processor = loaded
    chosen = {"other model": dict(draft_model=other, num_draft_tokens=3),
              "mtp": dict(mtp=True, num_draft_tokens=3)}[kind]
    options = [SamplingOptions(max_tokens=NEW, temperature=1.0, seed=10 + i) for i in range(4)]
    alone = [[r.token for r in mlxvlm.stream_generate(
        model, processor, user(None, text), image=[image], max_tokens=NEW, temperature=1.0,
        seed=10 + i, **({"draft_model": (other, processor)} if "draft_model" in chosen else {}),
        **{k: v for k, v in chosen.items() if k != "draft_model"})]
        for i, (text, image) in enumerate(zip(TEXTS, IMAGES))]
    engine = engine_of(loaded, Speculation(**chosen))
    assert tokens_of(submit_all(engine, loaded, options)) == alone
    assert engine.stats.accepted_draft_tokens > 0


def test_grammar_logprobs_stop_strings_and_cancellation_beside_speculating_rows(family_models):
    loaded, other, alone = family_models("qwen2_vl")
    model, processor = loaded
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = json_schema_constraint(processor.tokenizer, eos_token_ids(processor), schema)
    stop = mlxvlm.generate(model, processor, user(None, TEXTS[2]), image=[IMAGES[2]],
                           max_tokens=NEW).text[6:9]
    options = [SamplingOptions(max_tokens=NEW, constraint=grammar),
               SamplingOptions(max_tokens=NEW, top_logprobs=3),
               SamplingOptions(max_tokens=NEW, stop=[stop]),
               SamplingOptions(max_tokens=NEW)]

    def run(speculation):
        engine = engine_of(loaded, speculation)
        received = [[] for _ in TEXTS]
        handles = []
        for i, (text, image) in enumerate(zip(TEXTS, IMAGES)):
            def deliver(step, got=received[i], last=i == 3):
                got.append(step)
                if last and len(got) == 5:
                    handles[3].cancel()
            handles.append(engine.submit(inputs_of(loaded, text, image), options[i], deliver))
        run_to_end(engine)
        return engine, received

    plain_engine, plain = run(None)
    engine, speculative = run(Speculation(draft_model=model, num_draft_tokens=3))
    assert engine.stats.drafted_tokens > 0 and engine.stats.peak_batch_size == 4
    assert tokens_of(speculative) == tokens_of(plain)
    grammar, with_logprobs, stopped, cancelled = speculative
    assert "".join(s.text for s in grammar).startswith('{"a"')
    for got, expected in zip(with_logprobs, plain[1]):
        assert got.logprob == pytest.approx(expected.logprob, abs=1e-4)
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in expected.top_logprobs]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_string == stop
    assert "".join(s.text for s in stopped) == "".join(s.text for s in plain[2])
    assert len(cancelled) == 5 and cancelled[-1].finish_reason is None
    assert engine.stats.requests_cancelled == 1 and engine.stats.active == 0


class FailsAt:
    """A processor that gives NaN scores from its ``at``-th call on."""

    def __init__(self, at):
        self.at = at

    def processor(self, max_tokens):
        import mlx.core as mx
        calls = []

        def process(history, logits):
            calls.append(None)
            return logits * mx.array(float("nan")) if len(calls) >= self.at else logits
        return process


def test_a_failing_row_ends_alone_and_the_others_answer_as_alone(family_models):
    loaded, other, alone = family_models("qwen3_5")
    model, processor = loaded
    options = [SamplingOptions(max_tokens=NEW) for _ in TEXTS]
    options[1] = SamplingOptions(max_tokens=NEW, extra_processors=(FailsAt(6),))
    engine = engine_of(loaded, Speculation(draft_model=other, num_draft_tokens=3))
    received = submit_all(engine, loaded, options)
    failed = received.pop(1)
    assert isinstance(failed[-1], SequenceFault) and 0 < len(failed) - 1 < NEW
    assert tokens_of(received) == [alone[0], alone[2], alone[3]]
    assert engine.stats.requests_failed == 1


def test_a_next_turn_reuses_a_batched_speculative_answer(family_models):
    loaded, other, alone = family_models("qwen3_5")
    model, processor = loaded
    engine = engine_of(loaded, Speculation(prompt_lookup_num_tokens=3),
                       prefix_cache=PrefixCache())
    received = submit_all(engine, loaded, [SamplingOptions(max_tokens=8)] * 4,
                          image_hashes=None)
    # (image_hashes None keeps those out of the cache: this one goes in)
    first_turn = user(None, TEXTS[0])
    steps: list = []
    engine.submit(inputs_of(loaded, TEXTS[0], IMAGES[0]), SamplingOptions(max_tokens=8),
                  steps.append, image_hashes=[image_hash(IMAGES[0])])
    # ... beside three other speculating requests
    for text, image in zip(TEXTS[1:], IMAGES[1:]):
        engine.submit(inputs_of(loaded, text, image), SamplingOptions(max_tokens=8),
                      lambda _: None)
    run_to_end(engine)
    answer = "".join(s.text for s in steps)
    messages = [*first_turn, {"role": "assistant", "content": answer},
                *user("What colours are in it?")]
    second: list = []
    engine.submit(prepare_inputs(processor, messages, [IMAGES[0]],
                                 feature_names=model.feature_names),
                  SamplingOptions(max_tokens=NEW), second.append,
                  image_hashes=[image_hash(IMAGES[0])])
    run_to_end(engine)
    assert second[0].cached_tokens > 0
    assert tokens_of([second])[0] == mlxvlm.generate(model, processor, messages,
                                                     image=[IMAGES[0]], max_tokens=NEW).tokens
    assert tokens_of(received) == [a[:8] for a in alone]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_draft_model_drafts_every_row_as_it_drafts_one(family_models, family, sampled):
    """``DraftBatch`` against one ``DraftModelDrafter`` per row, through random budgets
    (none, fewer than the most) and random verdicts: the same drafts and distributions."""
    import numpy as np

    from mlxvlm.batching.draft_batch import DraftBatch
    from mlxvlm.generate.draft_vocab import embedding_rows
    from mlxvlm.generate.drafters import DraftModelDrafter

    loaded, other, _ = family_models(family)
    rows = embedding_rows(loaded[0])
    options = SamplingOptions(max_tokens=NEW, **({"temperature": 1.0} if sampled else {}))
    inputs = [inputs_of(loaded, t, i) for t, i in zip(TEXTS[:3], IMAGES)]
    alone = [DraftModelDrafter(other, x, options, target_rows=rows, seed=7 + i)
             for i, x in enumerate(inputs)]
    batch = DraftBatch(other)
    rng = np.random.default_rng(0)
    for i, x in enumerate(inputs):
        drafter = DraftModelDrafter(other, x, options, target_rows=rows, seed=7 + i)
        first = int(rng.integers(0, 100))
        drafter.update(0, first)
        alone[i].update(0, first)
        batch.join(drafter)
    for _ in range(8):
        rooms = [int(rng.integers(0, 4)) for _ in alone]
        together = batch.propose(rooms)
        for drafter, room, (drafts, q) in zip(alone, rooms, together):
            expected, expected_q = drafter.propose(None, room) if room else ([], None)
            assert drafts == expected
            assert (q is None) == (expected_q is None)
            if q is not None:
                np.testing.assert_allclose(q, expected_q, atol=1e-5)
        verdicts = [(int(rng.integers(0, room + 1)), int(rng.integers(0, 100))) for room in rooms]
        for drafter, verdict in zip(alone, verdicts):
            drafter.update(*verdict)
        batch.update(verdicts)


class EveryOtherStep(SpeculationRule):
    def speculates(self, rows):
        self.steps += 1
        return self.steps % 2 == 0


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_steps_the_rule_turns_off_keep_the_answers(family_models, family):
    loaded, other, alone = family_models(family)
    prompts = [tuple(inputs_of(loaded, t, i).input_ids[0].tolist()) for t, i in zip(TEXTS, IMAGES)]
    speculation = OracleSpeculation(num_draft_tokens=4, answers=tuple(zip(prompts, map(tuple, alone))))
    engine = engine_of(loaded, speculation, rule=EveryOtherStep())
    assert tokens_of(submit_all(engine, loaded, [SamplingOptions(max_tokens=NEW)] * 4)) == alone
    assert 0 < engine.stats.accepted_draft_tokens < engine.stats.drafted_tokens


def test_the_rule_speculates_where_it_measured_more_tokens_per_second():
    rule = SpeculationRule()
    assert rule.speculates(4)  # nothing measured: try it
    rule.observe(4, True, tokens=12, seconds=1.0)
    assert not rule.speculates(4)  # then one plain step
    rule.observe(4, False, tokens=4, seconds=0.5)
    decisions = [rule.speculates(4) for _ in range(2 * rule.probe_every)]
    assert decisions.count(True) == 2 * rule.probe_every - 2  # 12/s beats 8/s; two probes
    for _ in range(6):  # speculation stops paying (e.g. the drafts start being rejected)
        rule.observe(4, True, tokens=4, seconds=1.0)
    decisions = [rule.speculates(4) for _ in range(2 * rule.probe_every)]
    assert decisions.count(True) == 2  # only the probes
    assert rule.speculates(8)  # another batch size is measured on its own
    assert all(SpeculationRule(adaptive=False).speculates(4) for _ in range(40))


def test_what_cannot_speculate_batched_is_refused(family_models):
    from mlxvlm.batching.sharded_engine import ShardedEngine

    (model, processor), _, _ = family_models("qwen2_vl")
    speculation = Speculation(prompt_lookup_num_tokens=2)
    with pytest.raises(MlxvlmError, match="needs whole KV caches"):
        BatchEngine(model, processor, max_batch_size=2, max_kv_size=512,
                    speculation=speculation)
    with pytest.raises(MlxvlmError, match="--max-concurrency 1"):
        ShardedEngine(model, processor, max_batch_size=2, speculation=speculation)


@pytest.mark.parametrize("family, flags", [
    ("qwen2_vl", ("--draft-model", "SELF", "--num-draft-tokens", "3")),
    ("qwen3_5", ("--mtp", "--num-draft-tokens", "2")),
])
def test_the_server_speculates_under_concurrency(tiny_checkpoints, family, flags):
    """``python -m mlxvlm.server --max-concurrency 4`` with a drafting flag: requests sent
    together answer as each sent alone."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from server_process import ServerProcess

    path = str(tiny_checkpoints.path(family, "hub"))
    flags = [path if flag == "SELF" else flag for flag in flags]
    texts = TEXTS

    def ask(server, text):
        body = {"model": "m", "messages": [{"role": "user", "content": text}],
                "max_tokens": 32, "temperature": 0.0}
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]

    with ServerProcess("--model", path, "--served-model-name", "m", "--max-concurrency", "4",
                       *flags) as server:
        alone = [ask(server, text) for text in texts]
        with ThreadPoolExecutor(len(texts)) as pool:
            together = list(pool.map(lambda text: ask(server, text), texts))
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert together == alone
    values = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("mlxvlm_")}
    assert values["mlxvlm_draft_tokens_total"] > 0
    assert values["mlxvlm_peak_batch_size"] >= 2
