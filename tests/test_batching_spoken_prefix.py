"""Spoken requests and the prefix cache, in process, on the tiny full Qwen3-Omni and
Qwen2.5-Omni (tests/tiny/qwen3_omni_speech.py, qwen2_5_omni_speech.py: their talkers
read the thinker's states from position 0), greedy thinker and talker:

- a spoken conversation's second turn (its first with an image; then the first turn's
  answer and a new user turn) reuses the first turn's entry -- every token its cache
  took in: the prompt and the answer but its last token -- and its text, codes and audio
  equal the same request's on an engine without a prefix cache, whatever the prefill
  chunk; the entry's bytes count its tap's records;
- a first turn whose speech may end before its text (2 talker frames) still leaves the
  records of every token its cache took in;
- a text turn reuses a spoken turn's entry and answers as cold; a spoken turn after a
  text turn reuses nothing (the text entry has no tap records) and speaks as cold;
- ``PrefixCache``: a spoken lookup takes only entries with tap records, never the disk's;
  the records count in the byte budget it evicts by;
- ``HiddenTap.resuming``: a tap started from a prefix's records and recording the rest
  holds what one tap recording all of it holds.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import mlxvlm
from mlxvlm.batching import BatchAudio, BatchEngine, BatchStep, SamplingOptions
from mlxvlm.batching.prefix_cache import PrefixCache, image_hash
from mlxvlm.generate.speech import SpeechRequest
from mlxvlm.models.layers.hidden_tap import HiddenTap, TapRecords
from mlxvlm.prompt import PreparedInputs, prepare_inputs
from omni_parity import media_turn
from tiny import make_image

pytest.importorskip("torch")  # the tiny checkpoint is built with transformers' classes

THINKER_TOKENS = 8
FRAMES = 12
IMAGE = make_image(112, 84, seed=1)
FOLLOW_UP = [{"role": "user", "content": "And a blue square?"}]


@pytest.fixture(scope="module")
def qwen3_omni(speaking_checkpoint):
    return mlxvlm.load(speaking_checkpoint)


@pytest.fixture(scope="module")
def qwen2_5_omni(speaking_qwen2_5_checkpoint):
    return mlxvlm.load(speaking_qwen2_5_checkpoint)


@pytest.fixture(params=["qwen3_omni", "qwen2_5_omni"])
def loaded(request):
    return request.getfixturevalue(request.param)


def answer(engine: BatchEngine, inputs: PreparedInputs, spoken: bool, frames: int = FRAMES):
    """The request's steps and (spoken) its speech, the engine running it alone."""
    items, done = [], threading.Event()

    def deliver(item):
        items.append(item)
        if (isinstance(item, BaseException)
                or (isinstance(item, BatchAudio) and item.speech is not None)
                or (not spoken and isinstance(item, BatchStep) and item.finish_reason)):
            done.set()

    engine.submit(inputs, SamplingOptions(max_tokens=THINKER_TOKENS, temperature=0.0),
                  deliver, image_hashes=[image_hash(IMAGE)] if inputs.num_images else [],
                  speech=SpeechRequest(None, 0, frames) if spoken else None)
    assert done.wait(300)
    assert not isinstance(items[-1], BaseException), items[-1]
    steps = [item for item in items if isinstance(item, BatchStep)]
    return steps, items[-1].speech if spoken else None


class Engines:
    """An engine with a prefix cache and one without, running until closed."""

    def __init__(self, loaded, **options):
        model, processor = loaded
        self.cached = BatchEngine(model, processor, prefix_cache=PrefixCache(), **options)
        self.cold = BatchEngine(model, processor, **options)
        self.cached.start()
        self.cold.start()

    def close(self):
        self.cached.close()
        self.cold.close()


@pytest.fixture
def engines(loaded, request):
    engines = Engines(loaded, **getattr(request, "param", {}))
    yield engines
    engines.close()


def first_turn(loaded) -> PreparedInputs:
    model, processor = loaded
    return prepare_inputs(processor, media_turn("image", text="What do you see?"),
                          image=[IMAGE], feature_names=getattr(model, "feature_names", None))


def next_turn(loaded, first: PreparedInputs, answer_ids: list[int]) -> PreparedInputs:
    """``first``'s prompt, its answer's tokens, then a new user turn (its image's features
    kept): the tokens a chat's next turn starts with."""
    model, processor = loaded
    follow_up = prepare_inputs(processor, FOLLOW_UP,
                               feature_names=getattr(model, "feature_names", None))
    ids = mx.concatenate([first.input_ids, mx.array([answer_ids], dtype=first.input_ids.dtype),
                          follow_up.input_ids], axis=1)
    return PreparedInputs(ids, first.features, num_images=first.num_images)


def assert_same_speech(ours, theirs):
    (steps, speech), (cold_steps, cold_speech) = ours, theirs
    assert [s.token for s in steps] == [s.token for s in cold_steps]
    np.testing.assert_array_equal(speech.codes, cold_speech.codes)
    np.testing.assert_array_equal(speech.audio, cold_speech.audio)


@pytest.mark.parametrize("engines", [{}, {"prefill_step_size": 16}], indirect=True,
                         ids=["one chunk", "chunks of 16"])
def test_a_spoken_turn_reuses_the_last_spoken_turn_and_speaks_as_cold(loaded, engines):
    first = first_turn(loaded)
    steps, _ = answer(engines.cached, first, spoken=True)
    assert steps[0].cached_tokens == 0
    entry, = engines.cached.prefix_cache._entries.values()
    fed = first.num_tokens + len(steps) - 1  # its last token is never fed
    assert entry.key.shape[0] == entry.tap.length == fed
    assert entry.nbytes == sum(c.nbytes for c in entry.cache) + entry.tap.nbytes
    assert entry.tap.nbytes > 0

    second = next_turn(loaded, first, [s.token for s in steps])
    reused = answer(engines.cached, second, spoken=True)
    assert reused[0][0].cached_tokens == fed
    assert_same_speech(reused, answer(engines.cold, second, spoken=True))


def test_a_turn_whose_speech_ends_first_still_leaves_whole_records(loaded, engines):
    """(Where a talker follows the thinker token by token its speech may end first.)"""
    first = first_turn(loaded)
    steps, speech = answer(engines.cached, first, spoken=True, frames=2)
    assert len(speech.codes) == 2 and len(steps) == THINKER_TOKENS  # the text went on
    entry, = engines.cached.prefix_cache._entries.values()
    assert entry.tap.length == entry.key.shape[0] == first.num_tokens + len(steps) - 1
    second = next_turn(loaded, first, [s.token for s in steps])
    reused = answer(engines.cached, second, spoken=True)
    assert reused[0][0].cached_tokens == entry.key.shape[0]
    assert_same_speech(reused, answer(engines.cold, second, spoken=True))


def test_text_and_spoken_turns_reuse_what_each_can(loaded, engines):
    first = first_turn(loaded)
    steps, _ = answer(engines.cached, first, spoken=True)
    second = next_turn(loaded, first, [s.token for s in steps])
    text_steps, _ = answer(engines.cached, second, spoken=False)  # reuses the spoken entry
    assert text_steps[0].cached_tokens == first.num_tokens + len(steps) - 1
    cold_steps, _ = answer(engines.cold, second, spoken=False)
    assert [s.token for s in text_steps] == [s.token for s in cold_steps]

    third = next_turn(loaded, second, [s.token for s in text_steps])
    spoken_after_text = answer(engines.cached, third, spoken=True)
    assert spoken_after_text[0][0].cached_tokens == 0  # the text entry has no records
    assert_same_speech(spoken_after_text, answer(engines.cold, third, spoken=True))


def records(length: int, width: int = 4, layer: int = 2) -> TapRecords:
    return TapRecords(layer, mx.arange(length)[None], mx.ones((1, length, width)),
                      mx.zeros((1, length, width)))


def kv_cache(length: int, width: int = 4) -> list[KVCache]:
    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 1, length, width)), mx.ones((1, 1, length, width)))
    return [cache]


def test_a_spoken_lookup_takes_only_entries_with_records():
    cache = PrefixCache()
    cache.insert(np.arange(10), kv_cache(10), None)
    key = np.arange(20)
    assert cache.lookup(key, spoken=True) is None
    assert cache.lookup(key).length == 10
    cache.insert(np.arange(6), kv_cache(6), None, tap=records(6))
    hit = cache.lookup(key, spoken=True)
    assert hit.length == 6 and hit.tap.length == 6
    # cut to the prefix it shares
    hit = cache.lookup(np.array([0, 1, 2, 3, 99, 98]), spoken=True)
    assert hit.length == 4 and hit.tap.length == 4
    np.testing.assert_array_equal(np.asarray(hit.tap.ids), [[0, 1, 2, 3]])
    assert hit.cache[0].offset == 4
    # records shorter than the key: the entry is kept without them
    cache = PrefixCache()
    cache.insert(np.arange(10), kv_cache(10), None, tap=records(9))
    assert cache.lookup(key, spoken=True) is None and cache.lookup(key).length == 10


def test_the_records_count_in_the_byte_budget():
    kv_bytes = sum(c.nbytes for c in kv_cache(10))
    tap = records(10)
    fits_the_cache_alone = PrefixCache(max_bytes=kv_bytes + tap.nbytes - 1)
    fits_the_cache_alone.insert(np.arange(10), kv_cache(10), None)
    assert len(fits_the_cache_alone) == 1
    fits_the_cache_alone.insert(np.arange(100, 110), kv_cache(10), None, tap=tap)
    assert len(fits_the_cache_alone) == 0  # the spoken entry is over the budget: evicted
    fits_both = PrefixCache(max_bytes=kv_bytes + tap.nbytes)
    fits_both.insert(np.arange(10), kv_cache(10), None, tap=tap)
    assert fits_both.nbytes == kv_bytes + tap.nbytes
    assert fits_both.lookup(np.arange(20), spoken=True).length == 10


def test_a_spoken_lookup_never_takes_a_disk_entry(tmp_path):
    from mlxvlm.batching.disk_prefix_cache import DiskPrefixCache

    disk = DiskPrefixCache(tmp_path, 1 << 30, "tiny")
    writer = PrefixCache(disk=disk)
    writer.insert(np.arange(10), kv_cache(10), None, tap=records(10))
    writer.close()
    reader = PrefixCache(disk=DiskPrefixCache(tmp_path, 1 << 30, "tiny"))
    assert reader.lookup(np.arange(20), spoken=True) is None  # the file has no records
    assert reader.lookup(np.arange(20)).length == 10


@pytest.mark.parametrize("layer", [0, 2])
def test_a_resumed_tap_holds_what_one_tap_recording_all_holds(qwen3_omni, layer):
    model, _ = qwen3_omni
    language_model = model.language_model
    decoder = language_model.model
    # ids the thinker's table has (MLX's gather does not check them: past the end it reads
    # whatever memory follows, which may differ between two passes)
    rows = decoder.embed_tokens.weight.shape[0]
    ids = mx.array(np.random.default_rng(0).integers(10, rows, (1, 12)))

    def record(tap, cache, part):
        decoder.hidden_tap = tap
        try:
            language_model(part, cache)
        finally:
            decoder.hidden_tap = None

    whole, cache = HiddenTap(layer), model.make_cache()
    record(whole, cache, ids[:, :7])
    prefix = whole.records()
    assert (prefix.hidden is None) == (layer == 0)
    record(whole, cache, ids[:, 7:])
    resumed = HiddenTap.resuming(prefix.cut(5))
    cache = model.make_cache()
    record(HiddenTap(layer), cache, ids[:, :5])
    record(resumed, cache, ids[:, 5:])
    assert resumed.positions() == whole.positions() == 12
    np.testing.assert_array_equal(np.asarray(resumed.records().ids), np.asarray(ids))
    for ours, theirs in zip(resumed.states(12), whole.states(12)):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(resumed.embeddings_between(3, 9)),
                                  np.asarray(whole.embeddings_between(3, 9)))
