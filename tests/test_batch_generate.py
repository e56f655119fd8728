"""``batch_generate`` and the engine's cache options: video and audio prompts (prepared by
``prepare_inputs``, as ``generate``'s) give ``generate``'s greedy answers; kv_bits and
max_kv_size work where mlx-lm's caches allow and are refused where they do not; the
decode step is scheduled before the previous tokens are read."""

from __future__ import annotations

import numpy as np
import pytest

from av_media import coloured_frames, sine, write_video
from tiny import make_image

import mlxvlm
from mlxvlm import batch_generate, generate
from mlxvlm.batching import BatchEngine, SamplingOptions
from mlxvlm.errors import MlxvlmError
from mlxvlm.media import load_video
from mlxvlm.prompt import prepare_inputs

PROMPT = "Describe this image."
IMAGE = make_image(112, 84, seed=1)


@pytest.fixture(scope="module")
def qwen(tiny_checkpoints):
    return mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = write_video(tmp_path_factory.mktemp("clip") / "clip.mp4",
                       coloured_frames(30, 96, 64, seed=15), fps=10)
    return load_video(path, fps=2.0)


def test_video_prompts_equal_generate(qwen, clip):
    model, processor = qwen
    prompts = ["What happens in this video?", "Describe this image.", "Hello"]
    videos, images = [clip, None, None], [None, IMAGE, None]
    alone = [generate(model, processor, p, image=i, video=v, max_tokens=16)
             for p, i, v in zip(prompts, images, videos)]
    together = batch_generate(model, processor, prompts, images, videos=videos, max_tokens=16)
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert together[0].prompt_tokens == alone[0].prompt_tokens > together[2].prompt_tokens


def test_audio_prompts_equal_generate(tiny_checkpoints):
    model, processor = mlxvlm.load(tiny_checkpoints.path("qwen2_5_omni", "hub"))
    prompts = ["Listen and tell me a story.", "What do you hear?", "Hello"]
    audios = [sine(1.0, 16000, 440.0), [sine(0.7, 16000, 900.0)], None]
    alone = [generate(model, processor, p, audio=a, max_tokens=12)
             for p, a in zip(prompts, audios)]
    together = batch_generate(model, processor, prompts, audios=audios, max_tokens=12)
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert alone[0].tokens != alone[2].tokens


def test_media_lists_must_match_the_prompts(qwen):
    with pytest.raises(MlxvlmError, match="2 prompts but 1 video"):
        batch_generate(*qwen, ["a", "b"], videos=[None])


def test_quantized_cache_in_a_batch_of_one_equals_generate(qwen):
    model, processor = qwen
    options = dict(max_tokens=12, kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    alone = generate(model, processor, PROMPT, IMAGE, **options)
    [batched] = batch_generate(model, processor, [PROMPT], [IMAGE], max_batch_size=1, **options)
    assert batched.tokens == alone.tokens
    with pytest.raises(MlxvlmError, match="kv_bits needs max_batch_size 1"):
        batch_generate(model, processor, [PROMPT, PROMPT], max_batch_size=2, kv_bits=8)


def test_rotating_cache_past_its_window_in_a_batch_of_one_equals_generate(qwen):
    model, processor = qwen
    alone = generate(model, processor, PROMPT, IMAGE, max_tokens=80, max_kv_size=60)
    [batched] = batch_generate(model, processor, [PROMPT], [IMAGE], max_batch_size=1,
                               max_tokens=80, max_kv_size=60)
    assert len(alone.tokens) == 80 and batched.tokens == alone.tokens
    # The window really rotates: a full cache answers otherwise.
    assert generate(model, processor, PROMPT, IMAGE, max_tokens=80).tokens != alone.tokens


def test_rotating_cache_in_a_batch_of_several(qwen):
    model, processor = qwen
    prompts, images = [PROMPT, "Hello there"], [IMAGE, None]
    alone = [generate(model, processor, p, i, max_tokens=10, max_kv_size=200)
             for p, i in zip(prompts, images)]
    together = batch_generate(model, processor, prompts, images, max_tokens=10, max_kv_size=200)
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    # mlx-lm's batched rotating cache keeps no tokens at its start: no wrapping there.
    with pytest.raises(MlxvlmError, match="would outgrow max_kv_size 60"):
        batch_generate(model, processor, prompts, images, max_tokens=80, max_kv_size=60)


def test_decode_steps_are_scheduled_before_the_tokens_before_them_are_read(qwen, monkeypatch):
    model, processor = qwen
    inputs = prepare_inputs(processor, "Hello there", feature_names=model.feature_names)
    built = []
    original = type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, ids, *a, **kw: (
        built.append(ids.shape[1]) or original(self, ids, *a, **kw)))
    steps_when_delivered = []
    engine = BatchEngine(model, processor, max_batch_size=2)
    engine.submit(inputs, SamplingOptions(max_tokens=5), lambda step: steps_when_delivered.append(
        sum(1 for n in built if n == 1)))
    while engine.has_work:
        engine.step()
    # Token 0 comes from the prompt's pass; token k (k >= 1) is read once the step for
    # token k + 1 is built, except the last: no step is built past max_tokens.
    assert steps_when_delivered == [0, 2, 3, 4, 4]
    assert sum(1 for n in built if n == 1) == 4
    np.testing.assert_equal(len(steps_when_delivered), 5)
