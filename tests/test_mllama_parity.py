"""Llama 3.2 Vision (``mllama``) against transformers (float32), on the tiny checkpoints
of tests/tiny/mllama.py in both layouts: first-pass logits and 24 greedy tokens for text
only, one image, two images of different sizes (tile layouts) and an image in a later
turn; the same tokens through the CLI, through batched decoding (rows with and without
images, different tile counts) and through the server's entry point with two requests
in flight; the cross-attention keys kept by the prefix cache for the next turn about the
same picture, never lent to a turn with another picture. Guards show the tests can fail:
another image changes the answer, and the text before an image reads it too (the even
attention transformers gives a token that attends to no tile).
"""

from __future__ import annotations

import copy
import threading

import mlx.core as mx
import numpy as np
import pytest
from server_harness import png_data_url
from server_harness import user as url_user
from server_process import ServerProcess

from parity import (
    LOGITS_ATOL,
    NEW_TOKENS,
    assert_another_image_changes_the_output,
    assert_batched_tokens_match,
    embedded,
    first_pass,
    load_transformers_model,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    parameter_list,
    reference,  # noqa: F401 (fixture)
    save_as_mlx_checkpoint,
    standard_cases,
    standard_parity_tests,
    transformers_logits,
    user,
)
from tiny import make_image
from tiny.mllama import LAYOUTS, SAMPLING
import mlxvlm
from mlxvlm import load
from mlxvlm.batching import BatchEngine, SamplingOptions
from mlxvlm.batching.prefix_cache import PrefixCache, image_hash, prompt_key
from mlxvlm.models import mllama
from mlxvlm.models.layers.cross_attention import CrossAttentionCache
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

FAMILY = "mllama"
IMAGE_A = make_image(60, 40, seed=1)  # two tiles side by side
IMAGE_B = make_image(30, 70, seed=2)  # two tiles stacked
IMAGE_A2 = make_image(60, 40, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(
    IMAGE_A, IMAGE_B, IMAGE_A2, text="Tell me a story about a red cat on a blue mat.",
    two_images=(None, "and", None, "Compare the two images."),
)


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests([(FAMILY, layout) for layout in LAYOUTS], CASES)
)


def generated(model, processor, case: str, max_tokens: int = NEW_TOKENS):
    messages, images = ALL_CASES[case]
    return mlxvlm.generate(model, processor, messages, image=images, max_tokens=max_tokens,
                           temperature=0.0)


# ---------------------------------------------------------------------- entry points


def test_cli_gives_transformers_tokens(tiny_checkpoints, reference, tmp_path, capsys):
    """``python -m mlxvlm.generate`` with --image: the reference's 24 tokens' text."""
    from mlxvlm.generate.__main__ import main as run_generate_cli

    picture = tmp_path / "picture.png"
    IMAGE_A.save(picture)
    path = tiny_checkpoints.path(FAMILY, "hub")
    code = run_generate_cli(["--model", str(path), "--image", str(picture), "--prompt",
                             "Describe this image.", "--max-tokens", str(NEW_TOKENS),
                             "--temperature", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    expected = mlxvlm.load(path)[1].tokenizer.decode(reference(FAMILY, "one_image").tokens,
                                                     skip_special_tokens=True)
    assert out == expected + "\n"


def test_sampling_defaults_come_from_generation_config(loaded):
    """The release samples (temperature 0.6, top-p 0.9); the loader reads them."""
    _, processor = loaded(FAMILY, "hub")
    defaults = processor.sampling_defaults.values
    assert (defaults["temperature"], defaults["top_p"]) == (SAMPLING["temperature"], SAMPLING["top_p"])


def test_batched_rows_get_transformers_tokens(loaded, reference):
    """Text only, one and two images (different tile counts) and a later-turn image,
    decoded together: rows with and without cross-attention keys of different lengths."""
    model, processor = loaded(FAMILY, "hub")
    assert_batched_tokens_match(model, processor, CASES, [reference(FAMILY, c) for c in CASES])


def test_server_entry_point_batches_and_reuses_the_picture(tiny_checkpoints, loaded):
    """``python -m mlxvlm.server``: two requests in flight at once, one picture and two
    (of other tile layouts), get their one-request answers; the next turn about the first
    picture reuses its cached prefix (cross-attention keys included) and still answers as
    a fresh prompt."""
    model, processor = loaded(FAMILY, "hub")
    first = [url_user("Describe this image.", png_data_url(IMAGE_A))]
    other = [url_user("Compare the two images.", png_data_url(IMAGE_B), png_data_url(IMAGE_A2))]
    path = tiny_checkpoints.path(FAMILY, "hub")
    answers = {}
    with ServerProcess("--model", str(path), "--served-model-name", "tiny-mllama") as server:
        client = server.openai_client()

        def ask(name, messages):
            answers[name] = client.chat.completions.create(
                model="tiny-mllama", messages=messages, temperature=0, max_tokens=12)

        threads = [threading.Thread(target=ask, args=item)
                   for item in (("first", first), ("other", other))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        follow_up = [*first, {"role": "assistant", "content": answers["first"].choices[0].message.content},
                     {"role": "user", "content": "And its colours?"}]
        ask("follow_up", follow_up)

    def alone(messages, images):
        chat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                 [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
                for m in messages]
        return mlxvlm.generate(model, processor, chat, image=images, max_tokens=12,
                               temperature=0.0).text

    assert answers["first"].choices[0].message.content == alone(first, [IMAGE_A])
    assert answers["other"].choices[0].message.content == alone(other, [IMAGE_B, IMAGE_A2])
    follow = answers["follow_up"]
    assert follow.usage.prompt_tokens_details.cached_tokens > 0
    assert follow.choices[0].message.content == alone(follow_up, [IMAGE_A])


def test_chunks_and_speculation_keep_the_image_keys(loaded, reference):
    """A prompt prefilled 3 tokens at a time (the first chunk projects the image's keys,
    later chunks read them at their own positions) and prompt-lookup speculation (passes
    of several tokens, rejected ones trimmed from the self-attention caches only) give
    the reference's tokens."""
    model, processor = loaded(FAMILY, "hub")
    messages, images = CASES["image_in_second_turn"]
    expected = reference(FAMILY, "image_in_second_turn").tokens
    for options in ({"prefill_step_size": 3}, {"prompt_lookup_num_tokens": 3}):
        out = mlxvlm.generate(model, processor, messages, image=images, temperature=0.0,
                              max_tokens=NEW_TOKENS, **options)
        assert out.tokens == expected, options


def test_rotating_and_quantized_caches_leave_the_image_keys_alone(loaded, reference):
    """--max-kv-size rotates and --kv-bits quantizes only the self-attention layers'
    caches; until anything is evicted (or with 8 bits, at first) the answer is the
    reference's."""
    model, processor = loaded(FAMILY, "hub")
    messages, images = CASES["two_images"]
    ref = reference(FAMILY, "two_images")
    rotating = mlxvlm.generate(model, processor, messages, image=images, temperature=0.0,
                               max_tokens=NEW_TOKENS, max_kv_size=len(ref.input_ids) + NEW_TOKENS // 2)
    assert rotating.tokens[: NEW_TOKENS // 2] == ref.tokens[: NEW_TOKENS // 2]
    quantized = mlxvlm.generate(model, processor, messages, image=images, temperature=0.0,
                                max_tokens=NEW_TOKENS, kv_bits=8, kv_group_size=32,
                                quantized_kv_start=0)
    assert len(quantized.tokens) == NEW_TOKENS and quantized.tokens[:4] == ref.tokens[:4]


# ----------------------------------------------------------------- the prefix cache


def submitted(engine, model, processor, messages, images, max_tokens=NEW_TOKENS) -> list:
    inputs = prepare_inputs(processor, messages, list(images), feature_names=model.feature_names)
    steps: list = []
    engine.submit(inputs, SamplingOptions(max_tokens=max_tokens), steps.append,
                  image_hashes=[image_hash(i) for i in images])
    while engine.has_work:
        engine.step()
    return steps


def test_a_new_picture_never_reuses_the_earlier_turn(loaded, reference):
    """Text before an image reads the image (the even attention), so a turn that adds a
    picture shares nothing with the text-only turn before it, and answers as
    transformers does; the same turn asked again reuses all but its last token."""
    model, processor = loaded(FAMILY, "hub")
    engine = BatchEngine(model, processor, prefix_cache=PrefixCache())
    messages, images = CASES["image_in_second_turn"]
    submitted(engine, model, processor, messages[:1], [], max_tokens=4)
    steps = submitted(engine, model, processor, messages, images)
    assert steps[0].cached_tokens == 0
    assert [s.token for s in steps] == reference(FAMILY, "image_in_second_turn").tokens
    again = submitted(engine, model, processor, messages, images)
    assert again[0].cached_tokens == steps[0].prompt_tokens - 1
    assert [s.token for s in again] == [s.token for s in steps]


def test_prompts_with_images_are_keyed_by_all_of_them():
    """The same tokens before an image share a key only under the same images."""
    ids = [5, 6, 7, 9, 8]
    a = prompt_key(ids, [9], ["a"], images_reach_every_token=True)
    b = prompt_key(ids, [9], ["b"], images_reach_every_token=True)
    assert not (a[:3] == b[:3]).any()
    assert (a == prompt_key(ids, [9], ["a"], images_reach_every_token=True)).all()
    text = prompt_key([5, 6, 7], [9], [], images_reach_every_token=True)
    assert text.tolist() == [5, 6, 7]
    assert (prompt_key(ids, [9], ["a"])[:3] == text).all()  # (other families: shared)


# ------------------------------------------------------- the cross-attention cache


def test_cross_attention_keys_are_projected_once(loaded):
    """Every cross-attention layer's cache holds the image's keys after the prompt (one
    per image position: images x tiles x patches) and decoding reuses them; the cache
    counts no tokens and a trim leaves it whole."""
    model, processor = loaded(FAMILY, "hub")
    input_ids, embeddings, state = embedded(model, processor, *CASES["two_images"])
    cache = model.make_cache()
    model(input_ids, cache, embeddings=embeddings, state=state)
    cross = [c for c in cache if isinstance(c, CrossAttentionCache)]
    assert len(cross) == len(model.args.cross_attention_layers) > 0
    positions = state.blocks[0] * state.block_size
    assert all(c.keys.shape[2] == positions and c.holds(state.source_id) for c in cross)
    keys = cross[0].keys
    model(mx.array([[11]]), cache, state=state)
    assert cross[0].keys is keys
    trimmed = copy.deepcopy(cross[0])
    assert trimmed.trim(3) == 0 and trimmed.keys is keys
    assert not hasattr(trimmed, "offset")
    # A prompt-cache entry keeps the state without the image states (its keys are here).
    assert model.stored_state(state).source is None and state.source is not None


def test_batched_cross_attention_rows_pad_and_come_back():
    """merge / extend / filter / extract as the batching engine uses them: rows padded at
    the end to the longest, an empty row (no image) kept, each row back as it was."""
    def filled(length, value):
        cache = CrossAttentionCache()
        keys = mx.full((1, 2, length, 4), value)
        cache.fill(keys, keys + 1, source_id=None)
        return cache

    rows = [filled(3, 1.0), CrossAttentionCache(), filled(5, 2.0)]
    batch = CrossAttentionCache.merge([rows[0]])
    batch.extend(CrossAttentionCache.merge([rows[1]]))
    batch.extend(CrossAttentionCache.merge([rows[2]]))
    assert batch.keys.shape == (3, 2, 5, 4) and batch.row_lengths() == [3, 0, 5]
    assert batch.extract(1).empty()
    np.testing.assert_array_equal(np.array(batch.extract(0).values), np.array(rows[0].values))
    batch.filter([2, 0])
    assert batch.row_lengths() == [5, 3]
    np.testing.assert_array_equal(np.array(batch.extract(0).keys), np.array(rows[2].keys))


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_text_before_the_image_reads_it(loaded, reference):
    """Run without the image (no cross-attention): the tokens before the image are far
    off the reference, which gives them the even attention over the image."""
    model, processor = loaded(FAMILY, "hub")
    input_ids, embeddings, state = embedded(model, processor, *CASES["image_in_second_turn"])
    before = state.source_positions[0]
    logits = first_pass(model, input_ids, embeddings, None)
    ref = reference(FAMILY, "image_in_second_turn").logits
    assert np.abs(logits[:before] - ref[:before]).max() > 100 * LOGITS_ATOL


def test_the_tiles_padding_mask_matters(loaded, reference, monkeypatch):
    """Without the vision encoder's padding mask (the image's unused tiles and each
    tile's padded positions) the logits are far off the reference."""
    from mlxvlm.models.feature_cache import no_feature_cache
    from mlxvlm.models.layers import mllama_vision

    model, processor = loaded(FAMILY, "hub")
    monkeypatch.setattr(mllama_vision, "padding_attention_mask", lambda *_: None)
    with no_feature_cache():  # (neither the cached features nor new ones without the mask)
        input_ids, embeddings, state = embedded(model, processor, *CASES["one_image"])
    logits = first_pass(model, input_ids, embeddings, state)
    assert np.abs(logits - reference(FAMILY, "one_image").logits).max() > 100 * LOGITS_ATOL


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it into the same model."""
    path = tiny_checkpoints.path(FAMILY, "hub")
    logits = transformers_logits(load_transformers_model(path), mllama.load_processor(path, {}),
                                 *CASES["one_image"])
    np.testing.assert_array_equal(logits, reference(FAMILY, "one_image").logits)


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == new


def test_an_mlx_community_layout_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    """Our names are mlx-community's (``vision_tower.*``, the patch convolution channels
    last): such a checkpoint is not sanitized again and gives the same logits."""
    model, _ = loaded(FAMILY, "hub")
    names = {name for name, _ in parameter_list(model)}
    for name in ("vision_tower.patch_embedding.weight",
                 "vision_tower.global_transformer.layers.0.gate_attn",
                 "vision_tower.gated_positional_embedding.tile_embedding.weight",
                 "multi_modal_projector.weight",
                 "language_model.model.layers.1.cross_attn.k_norm.weight",
                 "language_model.model.layers.1.cross_attn_mlp_gate",
                 "language_model.model.layers.0.self_attn.q_proj.weight",
                 "language_model.lm_head.weight"):
        assert name in names, name
    mlx_model, processor = load(save_as_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"),
                                                       tmp_path))
    input_ids, embeddings, state = embedded(mlx_model, processor, *CASES["two_images"])
    np.testing.assert_allclose(first_pass(mlx_model, input_ids, embeddings, state),
                               reference(FAMILY, "two_images").logits, rtol=0, atol=LOGITS_ATOL)
