"""The shared generate loop through the public API, on a tiny Qwen2-VL checkpoint:
sampling with a seed, stop strings, end-of-sequence and length stops, statistics, and the
loop's own input checks."""

from __future__ import annotations

import pytest

from tiny import make_image
from mlxvlm import generate, load, stream_generate
from mlxvlm.errors import MlxvlmError, PromptTooLongError
from mlxvlm.text.tokenization import processor_state

IMAGE = make_image(112, 84, seed=1)
PROMPT = "Describe this image."


@pytest.fixture(scope="module")
def qwen(tiny_checkpoints):
    return load(tiny_checkpoints.path("qwen2_vl", "hub"))


def test_seeded_sampling_is_reproducible_and_seed_matters(qwen):
    model, processor = qwen
    runs = [
        generate(model, processor, PROMPT, IMAGE, max_tokens=16, temperature=1.5, seed=seed).tokens
        for seed in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    greedy = generate(model, processor, PROMPT, IMAGE, max_tokens=16).tokens
    assert runs[0] != greedy  # temperature 1.5 really samples


def test_max_tokens_ends_with_length_and_statistics(qwen):
    model, processor = qwen
    results = list(stream_generate(model, processor, PROMPT, IMAGE, max_tokens=5))
    assert len(results) == 5
    assert [r.finish_reason for r in results] == [None] * 4 + ["length"]
    last = results[-1]
    assert last.generation_tokens == 5
    assert last.prompt_tokens > 12  # 12 image tokens plus the text
    assert last.prompt_tps > 0 and last.generation_tps > 0 and last.peak_memory > 0
    assert last.logprobs.shape == (model.args.text.vocab_size,)


def test_decode_steps_are_scheduled_one_ahead_and_no_further(qwen, monkeypatch):
    """Each token's step is built before the previous token is read (overlapping graph
    building with computation), except that on the CPU the first token is read before the
    second step is scheduled (MLX's async_eval there returns only once most of a step
    has run, so the first token would wait for two); no step is built past max_tokens."""
    import mlx.core as mx

    model, processor = qwen
    built = []  # decode steps built (one-token model calls) when each token arrives
    original = type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, ids, *a, **kw: (
        built.append(ids.shape[1]) or original(self, ids, *a, **kw)))
    seen = []
    for result in stream_generate(model, processor, PROMPT, IMAGE, max_tokens=4):
        seen.append(sum(1 for length in built if length == 1))
    # The first token comes from the prompt's pass itself (its last chunk, here the whole
    # prompt, with the last position's logits): no one-token pass for the prompt's end.
    assert [length for length in built if length > 1] == [result.prompt_tokens]
    first_built = 0 if mx.default_device() == mx.cpu else 1
    assert seen == [first_built, 2, 3, 3]
    assert len(built) == 4  # 4 tokens: the prompt's pass and 3 decoding steps


def test_text_segments_join_to_the_decoded_tokens(qwen):
    model, processor = qwen
    out = generate(model, processor, PROMPT, IMAGE, max_tokens=20)
    assert out.text == processor.tokenizer.decode(out.tokens)


def test_stop_string_cuts_the_text(qwen):
    model, processor = qwen
    full = generate(model, processor, PROMPT, IMAGE, max_tokens=20)
    stop = full.text[6:9]
    assert len(stop) == 3 and stop.strip()
    cut = generate(model, processor, PROMPT, IMAGE, max_tokens=20, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.tokens) < len(full.tokens)


def test_eos_token_stops_without_text(qwen):
    model, processor = qwen
    first = generate(model, processor, PROMPT, IMAGE, max_tokens=3).tokens
    processor_state(processor).eos_token_ids = processor_state(processor).eos_token_ids | {first[1]}
    try:
        out = generate(model, processor, PROMPT, IMAGE, max_tokens=10)
    finally:
        processor_state(processor).eos_token_ids = processor_state(processor).eos_token_ids - {first[1]}
    assert out.finish_reason == "stop"
    assert out.tokens == first[:2]
    assert out.text == processor.tokenizer.decode(first[:1])


def test_repetition_penalty_changes_greedy_output(qwen):
    model, processor = qwen
    plain = generate(model, processor, PROMPT, IMAGE, max_tokens=24).tokens
    penalized = generate(
        model, processor, PROMPT, IMAGE, max_tokens=24, repetition_penalty=3.0
    ).tokens
    assert plain != penalized


def test_quantized_kv_cache_generates(qwen):
    model, processor = qwen
    out = generate(
        model, processor, PROMPT, IMAGE, max_tokens=8, kv_bits=8, kv_group_size=32,
        quantized_kv_start=0,
    )
    assert len(out.tokens) == 8


def test_rotating_cache_runs_far_past_its_window(qwen):
    model, processor = qwen
    out = generate(model, processor, PROMPT, IMAGE, max_tokens=80, max_kv_size=60)
    assert len(out.tokens) == 80


def test_rotating_window_too_small_for_the_images_is_a_clear_error(qwen):
    model, processor = qwen
    with pytest.raises(PromptTooLongError, match="--max-kv-size 10 is too small"):
        generate(model, processor, PROMPT, IMAGE, max_tokens=4, max_kv_size=10)


def test_prompt_longer_than_the_context(qwen):
    model, processor = qwen
    with pytest.raises(PromptTooLongError, match=r"context is 1024 tokens"):
        generate(model, processor, "cat " * 600, max_tokens=4)


def test_generation_stops_at_the_context_end(qwen):
    model, processor = qwen
    prompt = "cat " * 490  # two tokens each: ~1000 prompt tokens
    n_prompt = next(stream_generate(model, processor, prompt, max_tokens=1)).prompt_tokens
    out = generate(model, processor, prompt, max_tokens=500)
    assert n_prompt + len(out.tokens) <= 1024
    if out.finish_reason == "length":
        assert n_prompt + len(out.tokens) == 1024


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"prefill_step_size": 0}, "prefill_step_size"),
        ({"kv_bits": 4, "max_kv_size": 64}, "cannot be combined"),
    ],
)
def test_bad_options_are_rejected(qwen, options, message):
    model, processor = qwen
    with pytest.raises(MlxvlmError, match=message):
        generate(model, processor, PROMPT, IMAGE, **options)


def test_image_part_without_an_image_is_rejected(qwen):
    model, processor = qwen
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    with pytest.raises(MlxvlmError, match="image part with no image"):
        generate(model, processor, messages, max_tokens=2)


def test_system_prompt_is_rendered(qwen):
    model, processor = qwen
    from mlxvlm.prompt import prepare_inputs

    inputs = prepare_inputs(processor, "Hi", system="You are a pirate.")
    assert "You are a pirate." in inputs.prompt_text
    assert "You are a helpful assistant." not in inputs.prompt_text


def test_the_loop_never_imports_the_command_line():
    """Entry points import the shared loop, never the reverse (no cli <-> generate circle)."""
    import ast
    import sys
    from pathlib import Path

    package = sys.modules["mlxvlm.generate"]  # the attribute is the generate function

    for path in Path(package.__file__).parent.glob("*.py"):
        if path.name == "__main__.py":
            continue
        names = {node.module for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ImportFrom) and node.module}
        assert "mlxvlm.cli" not in names, path.name
