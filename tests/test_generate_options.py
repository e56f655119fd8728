"""``stream_generate``'s options objects (sampling, cache, media, speculation) against the
flat keywords it has always taken, on a tiny Qwen2-VL checkpoint: the same request either
way gives the same tokens, every old keyword is still accepted, and a misspelt keyword or
a value given both ways is a TypeError."""

from __future__ import annotations

import pytest

from tiny import make_image
from mlxvlm import (
    CacheOptions,
    MediaOptions,
    SamplingOptions,
    SpeculationOptions,
    batch_generate,
    generate,
    load,
    stream_generate,
)
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.keywords import fold_keywords
from mlxvlm.media import MediaError, MediaPolicy

IMAGE = make_image(112, 84, seed=1)
PROMPT = "Describe this image."
# stream_generate's keywords before the options objects (its signature as of issue 40):
# each must still be accepted.
OLD_KEYWORDS = (
    "video", "audio", "fps", "max_frames", "max_tokens", "temperature", "top_p", "top_k",
    "min_p", "repetition_penalty", "repetition_context_size", "presence_penalty",
    "frequency_penalty", "logit_bias", "top_logprobs", "seed", "max_kv_size", "kv_bits",
    "kv_group_size", "quantized_kv_start", "prefill_step_size", "stop", "json_schema",
    "system", "raw_prompt", "sampler", "logits_processors", "prompt_progress_callback",
    "media_policy", "chat_template_kwargs", "draft_model", "num_draft_tokens",
    "prompt_lookup_num_tokens",
)
SAMPLED = dict(temperature=1.2, top_p=0.95, top_k=40, min_p=0.0, seed=5)


@pytest.fixture(scope="module")
def qwen(tiny_checkpoints):
    return load(tiny_checkpoints.path("qwen2_vl", "hub"))


def test_every_old_keyword_is_still_accepted():
    explicit = {"video", "audio", "max_tokens"}
    folded = fold_keywords("stream_generate", {}, {name: None for name in OLD_KEYWORDS
                                                  if name not in explicit})
    seen = set(folded.plain) | {n for group in folded.grouped.values() for n in group}
    assert seen >= set(OLD_KEYWORDS) - explicit


def test_objects_give_the_flat_keywords_tokens(qwen):
    model, processor = qwen
    flat = generate(model, processor, PROMPT, IMAGE, max_tokens=12, stop="zzz",
                    max_kv_size=400, **SAMPLED)
    grouped = generate(model, processor, PROMPT, IMAGE,
                       sampling=SamplingOptions(max_tokens=12, stop="zzz", **SAMPLED),
                       cache=CacheOptions(max_kv_size=400))
    assert grouped.tokens == flat.tokens
    greedy = generate(model, processor, PROMPT, IMAGE, max_tokens=12)
    assert flat.tokens != greedy.tokens  # the sampling values really reached the sampler


def test_speculation_object_speculates_like_the_flat_keyword(qwen):
    model, processor = qwen
    plain = generate(model, processor, PROMPT, IMAGE, max_tokens=10).tokens
    runs = [list(stream_generate(model, processor, PROMPT, IMAGE, max_tokens=10, **way))
            for way in ({"prompt_lookup_num_tokens": 2},
                        {"speculation": SpeculationOptions(prompt_lookup_num_tokens=2)})]
    for results in runs:
        assert results[-1].speculation is not None
        assert [r.token for r in results] == plain  # greedy speculation keeps the tokens
    both = SpeculationOptions(draft_model=model, prompt_lookup_num_tokens=2)
    with pytest.raises(MlxvlmError, match="choose one drafter"):
        generate(model, processor, PROMPT, IMAGE, max_tokens=4, speculation=both)


def test_media_object_carries_the_policy(qwen, tmp_path):
    model, processor = qwen
    path = tmp_path / "picture.png"
    IMAGE.save(path)
    assert generate(model, processor, PROMPT, str(path), max_tokens=2).generation_tokens == 2
    no_files = MediaPolicy(allow_local=False)
    for way in ({"media_policy": no_files}, {"media": MediaOptions(media_policy=no_files)}):
        with pytest.raises(MediaError):
            generate(model, processor, PROMPT, str(path), max_tokens=2, **way)


def test_media_options_check_their_values():
    assert MediaOptions(fps=2.0).video_options() == {"fps": 2.0}
    assert MediaOptions().video_options() == {}
    with pytest.raises(MlxvlmError, match="fps"):
        MediaOptions(fps=0).validate()
    with pytest.raises(MlxvlmError, match="max_frames"):
        MediaOptions(max_frames=0).validate()


def test_unknown_keyword_names_the_closest(qwen):
    model, processor = qwen
    with pytest.raises(TypeError, match="'temprature'; did you mean 'temperature'"):
        generate(model, processor, PROMPT, IMAGE, temprature=0.5)
    with pytest.raises(TypeError, match="'max_kv'; did you mean 'max_kv_size'"):
        generate(model, processor, PROMPT, IMAGE, max_kv=100)
    with pytest.raises(TypeError, match="unexpected keyword argument 'xyzzy'$"):
        generate(model, processor, PROMPT, IMAGE, xyzzy=1)


@pytest.mark.parametrize("objects, flat", [
    ({"sampling": SamplingOptions()}, {"temperature": 0.5}),
    ({"sampling": SamplingOptions()}, {"max_tokens": 4}),
    ({"cache": CacheOptions()}, {"max_kv_size": 100}),
    ({"media": MediaOptions()}, {"fps": 1.0}),
    ({"speculation": SpeculationOptions()}, {"num_draft_tokens": 2}),
])
def test_a_value_given_both_ways_is_refused(qwen, objects, flat):
    model, processor = qwen
    name = next(iter(flat))
    with pytest.raises(TypeError, match=f"both {next(iter(objects))}= and {name}="):
        generate(model, processor, PROMPT, IMAGE, **objects, **flat)


def test_caller_options_are_left_as_they_were(qwen):
    model, processor = qwen
    options = SamplingOptions(max_tokens=3)
    out = generate(model, processor, PROMPT, IMAGE, sampling=options, json_schema=True)
    assert out.generation_tokens <= 3
    assert options.constraint is None  # the grammar went on a copy


def test_batch_generate_takes_the_same_objects(qwen):
    model, processor = qwen
    flat = batch_generate(model, processor, [PROMPT], [IMAGE], max_tokens=6, max_kv_size=400,
                          **SAMPLED)
    grouped = batch_generate(model, processor, [PROMPT], [IMAGE],
                             sampling=SamplingOptions(max_tokens=6, **SAMPLED),
                             cache=CacheOptions(max_kv_size=400), media=MediaOptions(fps=1.0))
    assert [o.tokens for o in grouped] == [o.tokens for o in flat]
    with pytest.raises(TypeError, match="both sampling= and seed="):
        batch_generate(model, processor, [PROMPT], sampling=SamplingOptions(), seed=1)
    with pytest.raises(TypeError, match="did you mean 'max_batch_size'"):
        batch_generate(model, processor, [PROMPT], max_batch=1)
