"""Speculative decoding against the same run without it: greedy output token for token
with a draft that is always accepted (the model itself), one that is almost always
rejected (another random model with the same tokenizer), prompt lookup and a text-only
draft, on an mlx-lm backbone (Idefics3), M-RoPE (Qwen2-VL), sliding-window rotating
caches (Gemma 3), recurrent states (Qwen3.5's Gated DeltaNet, LFM2's convolutions) and
``max_kv_size``; stop strings, EOS and logits processors inside drafted runs; the
acceptance rule against its exact maths; rejected tokens leave no trace in the cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxvlm import generate, load, stream_generate
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.acceptance import (
    acceptance_probability,
    accept_sampled,
    residual_distribution,
)
from mlxvlm.generate.drafters import PromptLookupDrafter
from mlxvlm.text.tokenization import processor_state
from tiny import TinyCheckpoints, make_image

IMAGE = make_image(112, 84, seed=1)
PROMPT = "Describe this image."
FAMILIES = ("idefics3", "qwen2_vl", "gemma3", "qwen3_5", "lfm2_vl")
NEW = 32


@pytest.fixture(scope="module")
def other_checkpoints(tmp_path_factory):
    """The same tiny families with other random weights (and the same tokenizers)."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-other"), seed=3)


@pytest.fixture(scope="module")
def models(tiny_checkpoints, other_checkpoints):
    loaded = {}

    def get(family):
        if family not in loaded:
            target = load(tiny_checkpoints.path(family, "hub"))
            other = load(other_checkpoints.path(family, "hub"))
            assert other[1].tokenizer.get_vocab() == target[1].tokenizer.get_vocab()
            loaded[family] = target, other
        return loaded[family]

    return get


def run(model, processor, **options):
    results = list(stream_generate(model, processor, PROMPT, IMAGE, **options))
    return [r.token for r in results], results[-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_the_same_with_every_drafter(models, family):
    (model, processor), other = models(family)
    plain, _ = run(model, processor, max_tokens=NEW)
    assert len(plain) >= 16  # some families end at EOS, inside a drafted pass

    tokens, last = run(model, processor, max_tokens=NEW, draft_model=(model, processor),
                       num_draft_tokens=4)
    assert tokens == plain
    spec = last.speculation
    assert spec.drafted > 0 and spec.accepted == spec.drafted  # the model agrees with itself
    assert spec.tokens_per_pass > 4  # 5 a pass but the budget's last pass

    tokens, last = run(model, processor, max_tokens=NEW, draft_model=other, num_draft_tokens=4)
    assert tokens == plain
    spec = last.speculation
    assert spec.drafted >= NEW and spec.accepted < spec.drafted / 4

    tokens, last = run(model, processor, max_tokens=NEW, prompt_lookup_num_tokens=3)
    assert tokens == plain
    spec = last.speculation
    # Never more passes than the plain loop's one a token.
    assert spec.target_passes <= len(plain) - 1


@pytest.mark.parametrize("family", ("qwen2_vl", "qwen3_5"))
def test_max_kv_size_rotation_is_the_same(models, family):
    """A rotating cache with attention sinks, well past its window (speculation stops
    once a pass would reach past it), under a draft that agrees and one that does not."""
    (model, processor), other = models(family)
    prompt_tokens = run(model, processor, max_tokens=1)[1].prompt_tokens
    options = dict(max_tokens=NEW + 8, max_kv_size=prompt_tokens + 12)
    plain, _ = run(model, processor, **options)
    for draft in ((model, processor), other):
        tokens, last = run(model, processor, draft_model=draft, num_draft_tokens=3, **options)
        assert tokens == plain
        assert last.speculation.drafted > 0


TEXT_DRAFT = dict(model_type="llama", hidden_size=32, num_hidden_layers=2,
                  intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-6,
                  num_key_value_heads=2)


def text_draft(vocab_size: int):
    """A random mlx-lm Llama over the target's ids (3 fewer: a draft's vocabulary may
    lack the target's last ids; the tiny Qwen2-VL's are its media placeholders, which a
    text-only draft is not fed, and padding)."""
    from mlx_lm.models import llama

    draft = llama.Model(llama.ModelArgs(**TEXT_DRAFT, vocab_size=vocab_size - 3))
    mx.eval(draft.parameters())
    return draft


def test_a_text_only_draft_sees_the_prompt_without_media(models, tmp_path):
    """An mlx-lm text model with the target's vocabulary as the draft (random: its drafts
    are rejected, the output stays the target's), given as a model and as a checkpoint
    that ``load_draft`` loads through mlx-lm."""
    from mlx_lm.utils import save_config, save_model

    from mlxvlm.generate.drafters import load_draft

    (model, processor), _ = models("qwen2_vl")
    plain, last = run(model, processor, max_tokens=NEW)
    vocab = last.logprobs.shape[-1]
    draft = text_draft(vocab)
    tokens, last = run(model, processor, max_tokens=NEW, draft_model=draft)
    assert tokens == plain
    assert last.speculation.drafted > 0

    save_model(tmp_path, draft)
    save_config({**TEXT_DRAFT, "vocab_size": vocab - 3}, tmp_path / "config.json")
    processor.tokenizer.save_pretrained(tmp_path)
    loaded, draft_processor = load_draft(str(tmp_path))
    assert draft_processor is None and type(loaded).__module__ == "mlx_lm.models.llama"
    tokens, last = run(model, processor, max_tokens=NEW, draft_model=str(tmp_path))
    assert tokens == plain


def test_stop_strings_eos_and_processors_inside_drafted_runs(models):
    (model, processor), _ = models("qwen2_vl")
    self_draft = dict(draft_model=(model, processor), num_draft_tokens=4)
    full = generate(model, processor, PROMPT, IMAGE, max_tokens=NEW)
    stop = full.text[6:9]
    plain = generate(model, processor, PROMPT, IMAGE, max_tokens=NEW, stop=[stop])
    drafted = generate(model, processor, PROMPT, IMAGE, max_tokens=NEW, stop=[stop], **self_draft)
    assert (drafted.text, drafted.finish_reason) == (plain.text, "stop")

    eos = full.tokens[7]  # drafted and accepted inside a pass
    processor_state(processor).eos_token_ids = processor_state(processor).eos_token_ids | {eos}
    try:
        drafted = generate(model, processor, PROMPT, IMAGE, max_tokens=NEW, **self_draft)
    finally:
        processor_state(processor).eos_token_ids = processor_state(processor).eos_token_ids - {eos}
    assert drafted.finish_reason == "stop"
    assert drafted.tokens == full.tokens[: full.tokens.index(eos) + 1]

    # Processors see, at every judged position, the tokens before it.
    options = dict(max_tokens=NEW, repetition_penalty=1.5, logit_bias={full.tokens[3]: 5.0})
    plain = generate(model, processor, PROMPT, IMAGE, **options).tokens
    assert plain != full.tokens
    assert generate(model, processor, PROMPT, IMAGE, **options, **self_draft).tokens == plain
    assert generate(model, processor, PROMPT, IMAGE, **options,
                    prompt_lookup_num_tokens=4).tokens == plain


def test_rejected_tokens_leave_no_trace_in_the_cache(models):
    """The target's KV cache after a run of rejected drafts holds what the plain loop's
    holds, position for position."""
    from mlxvlm.generate import CacheOptions, generate_tokens
    from mlxvlm.generate.drafters import make_drafter
    from mlxvlm.generate.speculative import SpeculationStats, speculative_tokens
    from mlxvlm.prompt import prepare_inputs
    from mlxvlm.sampling import RowSampler, SamplingOptions

    (model, processor), other = models("qwen2_vl")
    inputs = prepare_inputs(processor, PROMPT, IMAGE, feature_names=model.feature_names)
    options = SamplingOptions(max_tokens=NEW)

    def cache_after(speculate: bool):
        cache = CacheOptions().make(model, inputs)
        row = RowSampler(options, inputs.input_ids[0])
        if speculate:
            drafter = make_drafter(model, inputs, options, draft_model=other[0],
                                   prepare_draft_inputs=None)
            tokens = speculative_tokens(model, inputs, cache=cache, max_tokens=NEW, row=row,
                                        options=options, drafter=drafter, num_draft_tokens=4,
                                        stats=SpeculationStats())
        else:
            tokens = generate_tokens(model, inputs, cache=cache, max_tokens=NEW, row=row)
        out = [token for token, _ in tokens]
        return out, cache

    plain_tokens, plain_cache = cache_after(False)
    spec_tokens, spec_cache = cache_after(True)
    assert spec_tokens == plain_tokens
    length = min(plain_cache[0].offset, spec_cache[0].offset)
    assert length >= inputs.num_tokens + NEW - 2
    for plain_layer, spec_layer in zip(plain_cache, spec_cache):
        for a, b in ((plain_layer.keys, spec_layer.keys),
                     (plain_layer.values, spec_layer.values)):
            diff = mx.abs(a[..., :length, :] - b[..., :length, :]).max().item()
            assert diff < 1e-4


def test_sampling_with_a_self_draft_accepts_everything(models):
    """p = q: the rule accepts every draft, and a seed makes the run reproducible; another
    model's samples are mostly rejected (the residual draws the token instead)."""
    (model, processor), other = models("qwen2_vl")
    options = dict(max_tokens=NEW, temperature=1.0, top_p=0.9, top_k=50, seed=5,
                   num_draft_tokens=4)
    first, last = run(model, processor, draft_model=(model, processor), **options)
    assert last.speculation.accepted == last.speculation.drafted > 0
    assert run(model, processor, draft_model=(model, processor), **options)[0] == first
    tokens, last = run(model, processor, draft_model=other, **options)
    assert len(tokens) == NEW and tokens == run(model, processor, draft_model=other, **options)[0]
    assert 0 < last.speculation.drafted and last.speculation.accepted < last.speculation.drafted


def test_the_acceptance_rule_keeps_the_target_distribution():
    """Exactly: P(emit x) = q(x) min(1, p(x)/q(x)) + P(reject) residual(x) = p(x); and
    empirically, over two positions with a point-mass draft and a sampled one."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.6, 0.1, 0.2])
    accept = np.array([acceptance_probability(p, q, x) for x in range(4)])
    emitted = q * accept + (1 - (q * accept).sum()) * residual_distribution(p, q)
    np.testing.assert_allclose(emitted, p, atol=1e-12)

    rng = np.random.default_rng(0)
    draws = 40_000
    firsts = np.zeros(4)
    for _ in range(draws):
        draft = int(rng.choice(4, p=q))
        accepted, token = accept_sampled(np.stack([p, p]), [draft], q[None], rng)
        firsts[draft if accepted else token] += 1
    # Five standard errors of a frequency near 0.5 at 40,000 draws: 0.0125.
    np.testing.assert_allclose(firsts / draws, p, atol=0.0125)

    counts = np.zeros(4)
    for _ in range(draws):
        accepted, token = accept_sampled(np.stack([p, p]), [1], None, rng)
        counts[1 if accepted else token] += 1
    np.testing.assert_allclose(counts / draws, p, atol=0.0125)


def test_prompt_lookup_takes_the_latest_longest_match():
    drafter = PromptLookupDrafter(max_ngram=3)
    assert drafter.propose([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3], 2) == ([4, 5], None)
    assert drafter.propose([5, 6, 7, 5, 6, 8, 1, 5, 6], 3) == ([8, 1, 5], None)
    assert drafter.propose([1, 2, 3], 4) == ([], None)


@pytest.mark.parametrize("options, message", [
    (dict(prompt_lookup_num_tokens=2, json_schema=True), "json_schema"),
    (dict(prompt_lookup_num_tokens=0, draft_model="x"), "one drafter"),
    (dict(draft_model="unused", num_draft_tokens=0), "at least 1"),
])
def test_bad_speculation_options_are_refused(models, options, message):
    (model, processor), _ = models("qwen2_vl")
    with pytest.raises(MlxvlmError, match=message):
        generate(model, processor, PROMPT, IMAGE, max_tokens=4, **options)


def test_the_command_line_reports_acceptance(tiny_checkpoints, tmp_path, capsys):
    from mlxvlm.generate.__main__ import main as run_generate_cli

    path = tiny_checkpoints.path("qwen2_vl", "hub")
    image = tmp_path / "picture.png"
    IMAGE.save(image)
    args = ["--model", str(path), "--image", str(image), "--prompt", PROMPT, "--max-tokens", "12"]
    assert run_generate_cli(args) == 0
    plain = capsys.readouterr().out
    assert run_generate_cli([*args, "--draft-model", str(path), "--num-draft-tokens", "2",
                             "--verbose"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "[mlxvlm] speculation: 7/7 drafted tokens accepted (100.0%)" in out.err
    assert run_generate_cli([*args, "--prompt-lookup-num-tokens", "3"]) == 0
    assert capsys.readouterr().out == plain
