"""The per-image feature cache (mlxvlm/models/feature_cache.py): in a chat whose later turn
adds an image, the towers run on the new image only, and the logits are those of a model
without the cache (to float32 rounding); the same picture preprocessed another way is another entry;
the cache keeps to its byte bound, least recently used out first; the environment switch
turns it off; training never reads it; and the server shares it across requests."""

from __future__ import annotations

import copy
import dataclasses
import threading
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from parity import embedded, first_pass
from tiny import make_image

from mlxvlm import batch_generate, generate, load
from mlxvlm.models import feature_cache, run_ahead
from mlxvlm.models.feature_cache import FeatureCache, content_key, no_feature_cache

# Features from the cache were computed for their image alone or in another batch; with
# OpenBLAS, as users run, a matmul's rounding can depend on how many rows it has, so the
# results equal the uncached ones to float32 rounding rather than bit for bit. A wrong
# cache hit (another image's features) differs by O(1).
def assert_same(ours, expected):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), rtol=1e-4, atol=1e-4)


IMAGE_A = make_image(112, 84, seed=1)
IMAGE_B = make_image(84, 56, seed=2)
IMAGE_C = make_image(56, 84, seed=3)

TURN_1 = ([{"role": "user", "content": [
    {"type": "image"}, {"type": "text", "text": "Describe this image."}]}], [IMAGE_A])
TURN_2 = (TURN_1[0] + [
    {"role": "assistant", "content": "A red cat sits on a blue mat."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare the two images."}]},
], [IMAGE_A, IMAGE_B])
TURN_3 = (TURN_2[0] + [
    {"role": "assistant", "content": "The second one is smaller."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
], [IMAGE_A, IMAGE_B, IMAGE_C])

FAMILIES = [
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "gemma3", "idefics3", "llava",
    "llava_next", "llava_onevision", "pixtral", "mistral3", "qwen3_5", "lfm2_vl", "paddleocr_vl",
    "qwen3_omni_moe", "internvl", "minicpmv4_6", "minicpm_ocr",
]


# --------------------------------------------------------------------------------- helpers


def tower_entry(model) -> tuple[type, str, callable]:
    """(class, method, images-or-tiles-per-call) of the family's vision tower entry."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if family.startswith("qwen"):
        return type(model.vision_tower), "encode", lambda pixels, grids: len(np.reshape(grids, (-1, 3)))
    if family == "paddleocr_vl":
        return type(model.visual), "encode", lambda pixels, grids: len(np.reshape(grids, (-1, 3)))
    if family in ("gemma3", "paligemma"):
        return type(model.vision_tower), "__call__", lambda pixels: pixels.shape[0]
    if family == "idefics3":
        return type(model.vision_model), "__call__", lambda pixels, mask: pixels.shape[0]
    if family.startswith("llava"):
        return type(model.vision_tower), "hidden_states", lambda pixels, layers: pixels.shape[0]
    if family in ("pixtral", "mistral3"):
        return type(model.vision_tower), "__call__", lambda pixels, sizes, layer: len(sizes)
    if family == "lfm2_vl":  # one view (a tile, a thumbnail or an image) per call
        return type(model.vision_tower), "__call__", lambda patches, rows, columns: 1
    if family == "internvl":  # tiles (and frames)
        return type(model.vision_tower), "hidden_state", lambda pixels, layer: pixels.shape[0]
    if family in ("minicpmv4_6", "minicpm_ocr"):  # one view (the picture or a slice) per call
        return type(model.vision_tower), "__call__", lambda patches, rows, columns, merger: 1
    raise AssertionError(f"no tower spy for {family}")


@pytest.fixture
def encoded(monkeypatch):
    """``encoded(model)``: how many images (or tiles) the model's vision tower has been
    given so far, counted by a spy on the tower's entry point."""
    counts: dict[int, int] = {}

    def spy(model):
        cls, name, count = tower_entry(model)
        original = getattr(cls, name)
        if not getattr(original, "_spy", False):
            def counting(self, *args, **kwargs):
                counts[id(self)] = counts.get(id(self), 0) + count(*args, **kwargs)
                return original(self, *args, **kwargs)

            counting._spy = True
            monkeypatch.setattr(cls, name, counting)
        tower = next(getattr(model, name) for name in ("vision_model", "visual", "vision_tower")
                     if hasattr(model, name))
        return lambda: counts.get(id(tower), 0)

    return spy


def fresh_model(tiny_checkpoints, family: str, monkeypatch, cache_gb: str | None = None):
    if cache_gb is None:
        monkeypatch.delenv(feature_cache.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(feature_cache.ENV_VAR, cache_gb)
    return load(tiny_checkpoints.path(family, "transformers"))


def logits(model, processor, case) -> np.ndarray:
    return first_pass(model, *embedded(model, processor, *case))


def with_image_processor(processor, **changes):
    """A copy of ``processor`` whose image processor has ``changes`` (``size`` entries
    are replaced within the processor's SizeDict)."""
    processor = copy.deepcopy(processor)
    image_processor = processor.image_processor
    for name, value in changes.items():
        if name == "size":
            value = dataclasses.replace(image_processor.size, **value)
        setattr(image_processor, name, value)
    return processor


# ---------------------------------------------------------------------- (a) later turns


@pytest.mark.parametrize("family", FAMILIES)
def test_a_later_turn_encodes_only_its_new_image(family, tiny_checkpoints, monkeypatch, encoded):
    model, processor = fresh_model(tiny_checkpoints, family, monkeypatch)
    plain, _ = fresh_model(tiny_checkpoints, family, monkeypatch, cache_gb="0")
    count, plain_count = encoded(model), encoded(plain)

    turns = (TURN_1, TURN_2, TURN_3)
    items, expected = [], []  # images (or tiles) the tower gets for each turn, uncached
    for turn in turns:
        before = plain_count()
        expected.append(logits(plain, processor, turn))
        items.append(plain_count() - before)
    # The new image's items only. OneVision alone is different in the second turn: an
    # image among several is seen through a plain resize, not the tiling it gets alone.
    new_items = [items[0], items[1] if family == "llava_onevision" else items[1] - items[0],
                 items[2] - items[1]]
    assert min(new_items) >= 1

    for turn, new, reference in zip(turns, new_items, expected):
        before = count()
        ours = logits(model, processor, turn)
        assert count() - before == new, "an earlier turn's image was encoded again"
        # Bit for bit what the model without the cache computes.
        assert_same(ours, reference)
    before = count()
    assert_same(logits(model, processor, TURN_3), expected[2])
    assert count() == before, "a repeated prompt was encoded again"
    assert model.feature_cache.hits > 0


def test_qwen3_vl_deepstack_taps_come_from_the_cache_too(tiny_checkpoints, monkeypatch):
    model, processor = fresh_model(tiny_checkpoints, "qwen3_vl", monkeypatch)
    plain, _ = fresh_model(tiny_checkpoints, "qwen3_vl", monkeypatch, cache_gb="0")
    embedded(model, processor, *TURN_1)
    _, _, state = embedded(model, processor, *TURN_2)
    _, _, expected = embedded(plain, processor, *TURN_2)
    assert state.deepstack is not None
    np.testing.assert_array_equal(state.deepstack.positions, expected.deepstack.positions)
    for ours, theirs in zip(state.deepstack.layers, expected.deepstack.layers, strict=True):
        assert_same(ours, theirs)


def test_an_image_twice_in_one_prompt_is_encoded_once(tiny_checkpoints, monkeypatch, encoded):
    model, processor = fresh_model(tiny_checkpoints, "qwen2_vl", monkeypatch)
    plain, _ = fresh_model(tiny_checkpoints, "qwen2_vl", monkeypatch, cache_gb="0")
    count = encoded(model)
    twice = (TURN_2[0], [IMAGE_A, IMAGE_A])
    ours = logits(model, processor, twice)
    assert count() == 1
    assert_same(ours, logits(plain, processor, twice))


# ------------------------------------------------------------- (b) preprocessing settings


@pytest.mark.parametrize("family, changes", [
    ("qwen2_vl", {"size": {"longest_edge": 56 * 56 * 2}}),  # fewer patches
    ("idefics3", {"size": {"longest_edge": 32}}),  # other tiling
    ("gemma3", {"image_mean": (0.25, 0.5, 0.75)}),  # same shape, other values
    ("pixtral", {"size": {"longest_edge": 56}}),
    ("llava_next", {"image_std": (0.5, 0.5, 0.5)}),
])
def test_other_preprocessing_settings_are_another_entry(
    family, changes, tiny_checkpoints, monkeypatch, encoded
):
    model, processor = fresh_model(tiny_checkpoints, family, monkeypatch)
    plain, _ = fresh_model(tiny_checkpoints, family, monkeypatch, cache_gb="0")
    other = with_image_processor(processor, **changes)
    count = encoded(model)
    embedded(model, processor, *TURN_1)
    before, entries = count(), len(model.feature_cache)
    ours = logits(model, other, TURN_1)
    assert count() > before, "features of other preprocessing were taken from the cache"
    assert len(model.feature_cache) > entries
    assert_same(ours, logits(plain, other, TURN_1))


def test_content_key_covers_bytes_shape_dtype_and_extra_parts():
    pixels = np.arange(12, dtype=np.float32).reshape(3, 4)
    key = content_key("image", pixels, (1, 2, 2))
    assert key == content_key("image", pixels.copy(), (1, 2, 2))
    assert key == content_key("image", mx.array(pixels), (1, 2, 2))
    changed = pixels.copy()
    changed[2, 3] += 1
    others = [
        content_key("image", changed, (1, 2, 2)),
        content_key("image", pixels.reshape(4, 3), (1, 2, 2)),
        content_key("image", pixels.astype(np.float16), (1, 2, 2)),
        content_key("image", pixels, (1, 4, 1)),
        content_key("video", pixels, (1, 2, 2)),
        content_key("image", pixels),
    ]
    assert len({key, *others}) == 1 + len(others)
    bf16 = mx.array(pixels).astype(mx.bfloat16)
    assert content_key("image", bf16) != content_key("image", bf16.view(mx.uint16))


# ----------------------------------------------------------------------- (c) LRU bound


def entry(n: int, value: float = 1.0) -> tuple[mx.array]:
    return (mx.full((n,), value, dtype=mx.float32),)  # 4n bytes


def test_the_byte_bound_evicts_the_least_recently_used():
    cache = FeatureCache(max_bytes=400)
    for name in (b"a", b"b", b"c"):
        assert cache.put(name, entry(25))  # 100 bytes each
    assert cache.get(b"a") is not None  # a is now the most recently used
    assert cache.put(b"d", entry(50))  # 200 bytes: b goes
    assert [k for k in (b"a", b"b", b"c", b"d") if k in cache] == [b"a", b"c", b"d"]
    assert cache.nbytes == 400
    assert cache.put(b"e", entry(75))  # 300 bytes: c, then a, go
    assert [k for k in (b"a", b"b", b"c", b"d", b"e") if k in cache] == [b"e"]
    assert not cache.put(b"huge", entry(101))  # bigger than the bound: not stored
    assert b"huge" not in cache and b"e" in cache
    cache.put(b"e", entry(10))  # replacing an entry recounts its size
    assert cache.nbytes == 40
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_the_bound_evicts_a_models_earlier_image(tiny_checkpoints, monkeypatch, encoded):
    model, processor = fresh_model(tiny_checkpoints, "gemma3", monkeypatch)
    count = encoded(model)
    embedded(model, processor, *TURN_1)
    one_image = model.feature_cache.nbytes
    model.feature_cache = FeatureCache(max_bytes=one_image)  # room for one image only
    embedded(model, processor, *TURN_1)
    embedded(model, processor, TURN_1[0], [IMAGE_B])
    assert len(model.feature_cache) == 1 and model.feature_cache.nbytes <= one_image
    before = count()
    embedded(model, processor, *TURN_1)  # A was evicted by B
    assert count() == before + 1


def test_the_cache_is_thread_safe():
    cache = FeatureCache(max_bytes=64 * 40)
    errors = []

    def work(worker: int):
        try:
            for i in range(200):
                key = f"{worker}-{i % 50}".encode()
                if cache.get(key) is None:
                    cache.put(key, entry(16, value=worker))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.nbytes == 64 * len(cache) <= cache.max_bytes


def test_entries_own_their_buffers():
    """A stored item's features are not a view of the batch they were computed in: the
    batch's memory goes when the batch does."""
    model = types.SimpleNamespace(feature_cache=FeatureCache(max_bytes=10**9))
    batch = mx.random.normal((4, 1_000_000))  # 16 MB
    mx.eval(batch)
    outputs = feature_cache.cached_features(
        model, "image", [(np.full(1, i),) for i in range(2)],
        lambda indices: [(batch[i],) for i in indices],
    )
    assert model.feature_cache.nbytes == 8_000_000
    expected = np.array(batch[:2])
    before = mx.get_active_memory()
    del batch
    assert before - mx.get_active_memory() >= 16_000_000
    assert_same(np.array(mx.stack([o[0] for o in outputs])), expected)


# ------------------------------------------------------------------ (d) the env switch


def test_the_environment_variable_sets_or_disables_the_cache(tiny_checkpoints, monkeypatch, encoded):
    model, processor = fresh_model(tiny_checkpoints, "qwen2_vl", monkeypatch, cache_gb="0")
    assert not model.feature_cache.enabled
    count = encoded(model)
    embedded(model, processor, *TURN_1)
    embedded(model, processor, *TURN_1)
    assert count() == 2 and len(model.feature_cache) == 0

    monkeypatch.setenv(feature_cache.ENV_VAR, "0.5")
    assert FeatureCache().max_bytes == 500_000_000
    monkeypatch.delenv(feature_cache.ENV_VAR)
    assert FeatureCache().max_bytes == int(feature_cache.DEFAULT_GB * 1e9)
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(feature_cache.ENV_VAR, bad)
        with pytest.raises(ValueError, match=feature_cache.ENV_VAR):
            FeatureCache()


# ------------------------------------------------------------------------------ training


def test_training_bypasses_the_cache_and_gets_tower_gradients(tiny_checkpoints, monkeypatch, encoded):
    from mlxvlm.finetune.trainer import sequence_loss

    from mlxvlm.prompt import prepare_inputs

    model, processor = fresh_model(tiny_checkpoints, "qwen2_vl", monkeypatch)
    count = encoded(model)
    embedded(model, processor, *TURN_1)  # inference fills the cache
    assert len(model.feature_cache) == 1
    inputs = prepare_inputs(processor, *TURN_1, feature_names=model.feature_names)
    mask = mx.ones((inputs.input_ids.shape[1],))
    loss_and_grad = nn.value_and_grad(model, sequence_loss)
    lookups, before = (model.feature_cache.hits, model.feature_cache.misses), count()
    for _ in range(2):
        _, grads = loss_and_grad(model, inputs.input_ids, mask, inputs.features)
        tower_grad = grads["vision_tower"]["patch_embed"]["proj"]["weight"]
        assert mx.abs(tower_grad).max().item() > 0
    assert count() == before + 2  # the tower ran every time
    # The cache was never read nor filled (and the weights' update emptied it).
    assert (model.feature_cache.hits, model.feature_cache.misses) == lookups
    assert len(model.feature_cache) == 0

    with no_feature_cache():
        embedded(model, processor, *TURN_1)
    assert count() == before + 3


def test_new_weights_empty_the_cache(tiny_checkpoints, monkeypatch):
    model, processor = fresh_model(tiny_checkpoints, "qwen2_vl", monkeypatch)
    embedded(model, processor, *TURN_1)
    assert len(model.feature_cache) == 1
    weight = model.vision_tower.patch_embed.proj.weight
    model.update({"vision_tower": {"patch_embed": {"proj": {"weight": weight * 2}}}})
    assert len(model.feature_cache) == 0
    embedded(model, processor, *TURN_1)
    model.load_weights([("vision_tower.patch_embed.proj.weight", weight)], strict=False)
    assert len(model.feature_cache) == 0
    assert "feature_cache" not in dict(model.parameters())


# -------------------------------------------------------------------------------- server


def test_the_server_does_not_encode_an_earlier_image_again(tiny_checkpoints, monkeypatch, encoded):
    from server_harness import LiveServer, png_data_url, user

    model, processor = fresh_model(tiny_checkpoints, "qwen2_vl", monkeypatch)
    count = encoded(model)
    image_a = png_data_url(make_image(56, 56, seed=21))
    image_b = png_data_url(make_image(48, 64, seed=22))
    greedy = {"temperature": 0, "max_tokens": 4}
    with LiveServer(model, processor) as server:
        client = server.client()
        first = client.chat.completions.create(
            model="tiny-qwen2-vl", messages=[user("Describe this image.", image_a)], **greedy)
        assert count() == 1
        # Another conversation (no prompt prefix to reuse past the system prompt) with
        # a new image and the first one: only the new image goes through the tower.
        messages = [user("Compare these two images.", image_b, image_a)]
        second = client.chat.completions.create(model="tiny-qwen2-vl", messages=messages, **greedy)
        assert count() == 2
    assert first.choices[0].message.content and second.choices[0].message.content
    assert model.feature_cache.hits == 1


# ------------------------------------------------------------------------ video, audio


def test_a_video_is_encoded_once(tiny_checkpoints, monkeypatch, encoded):
    from av_media import coloured_frames

    from mlxvlm.prompt import prepare_inputs

    model, processor = fresh_model(tiny_checkpoints, "qwen2_vl", monkeypatch)
    plain, _ = fresh_model(tiny_checkpoints, "qwen2_vl", monkeypatch, cache_gb="0")
    count = encoded(model)
    frames = list(coloured_frames(6, 96, 64, seed=15))
    video_turn = [{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": "What happens in this video?"}]}]
    later = video_turn + [
        {"role": "assistant", "content": "A red cat sits on a blue mat."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And here?"}]},
    ]

    def run(m, messages, images):
        inputs = prepare_inputs(processor, messages, images, video=[frames],
                                feature_names=m.feature_names)
        embeddings, state = m.embed(inputs.input_ids, **inputs.features)
        return first_pass(m, inputs.input_ids, embeddings, state)

    run(model, video_turn, [])
    assert count() == 1
    ours = run(model, later, [IMAGE_A])
    assert count() == 2  # the image only
    assert_same(ours, run(plain, later, [IMAGE_A]))


def test_the_prompts_audio_is_encoded_once(tiny_checkpoints, monkeypatch):
    from av_media import sine

    from mlxvlm.prompt import prepare_inputs

    model, processor = fresh_model(tiny_checkpoints, "qwen2_5_omni", monkeypatch)
    plain, _ = fresh_model(tiny_checkpoints, "qwen2_5_omni", monkeypatch, cache_gb="0")
    calls = []
    original = type(model.audio_tower).__call__
    monkeypatch.setattr(type(model.audio_tower), "__call__",
                        lambda self, *a: calls.append(id(self)) or original(self, *a))
    audio = [sine(1.0, 16000, 440.0), sine(0.7, 16000, 900.0)]
    messages = [{"role": "user", "content": [
        {"type": "audio"}, {"type": "audio"}, {"type": "text", "text": "Listen and tell me a story."}]}]

    def run(m):
        inputs = prepare_inputs(processor, messages, audio=audio, feature_names=m.feature_names)
        embeddings, state = m.embed(inputs.input_ids, **inputs.features)
        return first_pass(m, inputs.input_ids, embeddings, state)

    first = run(model)
    second = run(model)
    assert calls.count(id(model.audio_tower)) == 1
    assert_same(first, second)
    assert_same(second, run(plain))


def test_towers_are_evaluated_a_layer_at_a_time():
    """bounded_run_ahead: on the CPU, MLX allocates each operation's output when it
    schedules it, far ahead of the computation; inside the context a tower's
    ``layer_done`` evaluates each layer's output before the next is scheduled. MLX's
    memory limit is left alone (over it, MLX's scheduler spins a core)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("the run-ahead bound applies to MLX's CPU backend only")
    weight = mx.random.normal((512, 512), key=mx.random.key(0)) * 0.04
    x = mx.random.normal((512, 512), key=mx.random.key(1))
    mx.eval(weight, x)

    def chain_peak() -> int:  # 40 "layers" of 1 MB each, only the last one kept
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        h = x
        for _ in range(40):
            h = h @ weight
            run_ahead.layer_done(h)
        mx.eval(h)
        return mx.get_peak_memory() - start

    unbounded = chain_peak()
    limit = mx.get_memory_limit()
    with run_ahead.bounded_run_ahead():
        assert run_ahead.active() and mx.get_memory_limit() == limit
        bounded = chain_peak()
    assert not run_ahead.active()
    assert bounded <= (3 << 20) < (20 << 20) < unbounded, (bounded, unbounded)


@pytest.mark.parametrize("engine", ["generate", "batch_generate"])
@pytest.mark.parametrize("cache_gb", ["0", None], ids=["cache-off", "cache-on"])
def test_generate_builds_the_towers_a_layer_at_a_time(
    tiny_checkpoints, monkeypatch, cache_gb, engine
):
    """With the feature cache off the towers are built and evaluated by the generate
    loop's own embedding step, with the cache on by the cache's: both inside the bound
    (without it, SmolVLM-256M's peak was 70 MB higher), for every tower layer, and the
    nested bound of the cache inside the loop's does not end the loop's."""
    if mx.default_device() != mx.cpu:
        pytest.skip("the run-ahead bound applies to MLX's CPU backend only")
    model, processor = fresh_model(tiny_checkpoints, "qwen2_vl", monkeypatch, cache_gb=cache_gb)
    calls = []
    original = run_ahead.layer_done

    def recording(*outputs):
        calls.append(run_ahead.active())
        return original(*outputs)

    monkeypatch.setattr(run_ahead, "layer_done", recording)
    messages, images = TURN_1
    if engine == "generate":
        generate(model, processor, messages, images, max_tokens=2)
    else:  # the server's batching engine
        batch_generate(model, processor, [messages], [images], max_tokens=2)
    assert len(calls) == len(model.vision_tower.blocks) and all(calls), calls
    assert not run_ahead.active()


# family -> the evaluations its tower makes for one image: one per layer, two per layer
# of the ViT encoder SigLIP and CLIP share (after the attention and after the MLP).
TOWER_EVALUATIONS = {
    "idefics3": lambda m: 2 * len(m.vision_model.encoder.layers),
    "qwen2_vl": lambda m: len(m.vision_tower.blocks),
    "gemma3": lambda m: 2 * len(m.vision_tower.vision_model.encoder.layers),
}


@pytest.mark.parametrize("family", ["idefics3", "qwen2_vl", "gemma3", "llava", "mistral3"])
def test_every_tower_evaluates_each_layer_inside_the_bound(tiny_checkpoints, monkeypatch,
                                                           family):
    """SigLIP, CLIP, Pixtral and Qwen's towers end each layer with ``layer_done``, the
    ViT encoder its attention half too (the same numbers as without the bound)."""
    model, processor = fresh_model(tiny_checkpoints, family, monkeypatch, cache_gb="0")
    messages, images = TURN_1
    _, want, _ = embedded(model, processor, messages, images)
    calls = []
    original = run_ahead.layer_done
    monkeypatch.setattr(run_ahead, "layer_done",
                        lambda *o: calls.append(run_ahead.active()) or original(*o))
    with run_ahead.bounded_run_ahead():
        _, got, _ = embedded(model, processor, messages, images)
    assert calls and all(calls)
    if family in TOWER_EVALUATIONS:
        assert len(calls) == TOWER_EVALUATIONS[family](model), len(calls)
    assert mx.array_equal(got, want)


def test_nested_run_ahead_bounds_keep_the_outer_one():
    if mx.default_device() != mx.cpu:
        pytest.skip("the run-ahead bound applies to MLX's CPU backend only")
    with run_ahead.bounded_run_ahead():
        with run_ahead.bounded_run_ahead():
            assert run_ahead.active()
        assert run_ahead.active()  # the inner exit does not end the outer bound
    assert not run_ahead.active()


def test_the_audio_tower_evaluates_each_layer_inside_the_bound(tiny_checkpoints, monkeypatch):
    """The Whisper-style audio encoder (Qwen2.5-Omni) ends each layer with ``layer_done``
    too, with the same numbers as without the bound."""
    from av_media import sine

    from mlxvlm.prompt import prepare_inputs

    model, processor = fresh_model(tiny_checkpoints, "qwen2_5_omni", monkeypatch, cache_gb="0")
    messages = [{"role": "user", "content": [
        {"type": "audio"}, {"type": "text", "text": "Listen and tell me a story."}]}]
    inputs = prepare_inputs(processor, messages, audio=[sine(1.0, 16000, 440.0)],
                            feature_names=model.feature_names)
    want, _ = model.embed(inputs.input_ids, **inputs.features)
    calls = []
    original = run_ahead.layer_done
    monkeypatch.setattr(run_ahead, "layer_done",
                        lambda *o: calls.append(run_ahead.active()) or original(*o))
    with run_ahead.bounded_run_ahead():
        got, _ = model.embed(inputs.input_ids, **inputs.features)
    assert len(calls) == len(model.audio_tower.layers) and all(calls), calls
    assert mx.array_equal(got, want)
