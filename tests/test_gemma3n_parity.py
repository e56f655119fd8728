"""Gemma 3n against transformers (float32), on tiny random checkpoints.

The model is loaded from both config layouts (transformers 5's and google/gemma-3n-*-it's,
see tests/tiny/gemma3n.py) through ``mlxvlm.load`` and compared with the in-memory
transformers model (its vision tower timm's MobileNetV5): logits of the first forward pass
and greedy tokens through ``mlxvlm.stream_generate``, for text only, one image, two images
of different sizes and an image in a later turn. Every prompt is longer than the 16-token
sliding window, and generation runs past it. Guards check that the tests can fail: another
image changes the output, and dropping the sliding window, the local rope θ, the activation
sparsity or the KV sharing changes the logits.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from parity import (
    CAUGHT,
    LOGITS_ATOL,
    assert_another_image_changes_the_output,
    assert_batched_tokens_match,
    assert_decode_steps_match,
    assert_rotating_cache_keeps_the_prompt,
    assert_wrong_model_is_caught,
    embedded,
    first_pass,
    load_transformers_model,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    our_logits,
    parameter_list,
    read_config,
    reference,  # noqa: F401 (fixture)
    standard_cases,
    standard_parity_tests,
    transformers_logits,
)
from tiny import make_image
from tiny.gemma3n import LAYOUTS, SLIDING_WINDOW
from mlxvlm import load
from mlxvlm.models import gemma3n

torch = pytest.importorskip("torch")

FAMILY = "gemma3n"
# MobileNetV5's deep convolution stack carries the BLAS's float32 rounding into the image
# tokens: with an image in the second turn one logit of 33,000 differs by 1.07e-4 (4.8e-5
# relative) on an AMD EPYC under Debian's OpenBLAS, and by less than 1e-4 with MLX's own
# matmuls; the greedy tokens are identical either way.
IMAGE_A = make_image(112, 84, seed=1)
IMAGE_B = make_image(84, 56, seed=2)
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(
    IMAGE_A, IMAGE_B, IMAGE_A2,
    text="Tell me a story about a red cat on a blue mat.",
    two_images=(None, "and", None, "Compare the two images."),
)


def logits_of(model, processor, case):
    return our_logits(model, processor, *ALL_CASES[case])


# ----------------------------------------------------------------------------------- parity


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests([(FAMILY, layout) for layout in LAYOUTS], CASES,
                          logits_atol={"image_in_second_turn": 2e-4})
)


@pytest.mark.parametrize("case", CASES)
def test_every_prompt_outgrows_the_sliding_window(case, reference):
    """(Our prompt ids are the reference's: see the first-pass test.)"""
    assert len(reference(FAMILY, case).input_ids) > SLIDING_WINDOW


def test_decode_steps_match_transformers(tiny_checkpoints, loaded, reference):
    """Teacher-forced on the reference's answer, every decode step (through the rotating
    sliding-window caches and the layers sharing them, well past the window) gives
    transformers' logits. (The other answers hold the image token itself, which
    transformers' one-pass forward would take for an image.)"""
    model, processor = loaded(FAMILY, "hub")
    assert_decode_steps_match(tiny_checkpoints.model(FAMILY).model, model, processor,
                              CASES["one_image"], reference(FAMILY, "one_image"))


def test_chunked_prefill_gives_the_same_tokens(loaded, reference):
    """Prefill in chunks of 5: the KV-sharing layers read what their owner layer cached
    in earlier chunks."""
    model, processor = loaded(FAMILY, "hub")
    tokens = [r.token for r in _stream(model, processor, "two_images", prefill_step_size=5)]
    assert tokens == reference(FAMILY, "two_images").tokens


def _stream(model, processor, case, **options):
    from mlxvlm import stream_generate

    messages, images = ALL_CASES[case]
    return stream_generate(model, processor, messages, image=images, max_tokens=24,
                           temperature=0.0, **options)


def test_batched_generation_gives_each_prompt_its_tokens(loaded, reference):
    model, processor = loaded(FAMILY, "hub")
    assert_batched_tokens_match(model, processor, CASES, [reference(FAMILY, c) for c in CASES])


def test_rotating_cache_keeps_the_prompt(loaded, reference):
    """With --max-kv-size the global layers' caches rotate too; until anything is evicted
    the tokens are the reference's."""
    model, processor = loaded(FAMILY, "transformers")
    assert_rotating_cache_keeps_the_prompt(model, processor, CASES["one_image"],
                                           reference(FAMILY, "one_image"))


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


@pytest.mark.parametrize("change", ["no_sliding_window", "default_local_theta", "dense_activations"])
def test_config_errors_would_be_caught(change, tiny_checkpoints, loaded, reference):
    """A loader that ignored the window, read the wrong rope key or the sparsity pattern
    would fail parity."""
    config = read_config(tiny_checkpoints, FAMILY, "hub")
    text = config["text_config"]
    if change == "no_sliding_window":
        text["sliding_window"] = 4096
    elif change == "default_local_theta":
        del text["rope_local_base_freq"]
    else:
        text["activation_sparsity_pattern"] = [0.0] * text["num_hidden_layers"]
    model, processor = loaded(FAMILY, "hub")
    assert_wrong_model_is_caught(gemma3n.Model.from_config(config), model, processor,
                                 CASES["image_in_second_turn"], reference(FAMILY, "image_in_second_turn"))


def test_kv_sharing_matters(loaded, reference):
    """The shared layers reading their own (fresh) keys instead of the owner's: the last
    two layers given a cache of their own would be far off."""
    model, processor = loaded(FAMILY, "hub")
    text_model = model.language_model.model
    saved = list(text_model.layer_idx_to_cache_idx)
    try:
        # Point the shared layers at the first layers' caches of their type instead.
        types = text_model.config.layer_types
        text_model.layer_idx_to_cache_idx = [
            i if i < model.first_shared_layer else types.index(types[i]) for i in range(len(saved))
        ]
        input_ids, embeddings, state = embedded(model, processor, *CASES["text"])
        logits = first_pass(model, input_ids, embeddings, state)
    finally:
        text_model.layer_idx_to_cache_idx = saved
    assert np.abs(logits - reference(FAMILY, "text").logits).max() > CAUGHT


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it into the same model."""
    ref = reference(FAMILY, "one_image")
    for layout in LAYOUTS:
        path = tiny_checkpoints.path(FAMILY, layout)
        logits = transformers_logits(load_transformers_model(path),
                                     gemma3n.load_processor(path, {}), *CASES["one_image"])
        np.testing.assert_allclose(logits, ref.logits, rtol=0, atol=1e-6)


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == new


def test_the_vision_layout_comes_from_the_config(tiny_checkpoints, loaded):
    """The tiny tower's blocks are the ones model_args lays out, not the 300M layout."""
    model, _ = loaded(FAMILY, "transformers")
    stages = model.vision_tower.timm_model.blocks
    assert [len(s) for s in stages] == [1, 2, 3, 3]
    assert type(stages[2][1]).__name__ == "MobileAttention"
    assert "down_conv" in stages[2][1].attn.key  # the keys' stride of 2 ("v2")
    assert gemma3n.mobilenet_v5.MOBILENETV5_300M == timm_300m_layout()
    full = gemma3n.mobilenet_v5.MobileNetV5Config.from_hf({"architecture": "mobilenetv5_300m_enc"})
    assert [len(s) for s in full.stages] == [3, 5, 37, 39]


def timm_300m_layout() -> list[list[str]]:
    """timm's block strings of mobilenetv5_300m (the ``else`` branch of its generator)."""
    import ast
    import inspect

    from timm.models import mobilenetv5

    tree = ast.parse(inspect.getsource(mobilenetv5._gen_mobilenet_v5))
    branch = next(n for n in ast.walk(tree) if isinstance(n, ast.If))
    return ast.literal_eval(branch.orelse[0].value)


def mlx_community_weights(model) -> dict[str, mx.array]:
    """Our parameters under mlx-community's names, with the unused KV projections of the
    shared layers that mlx-vlm's conversions store (random here)."""
    weights = dict(parameter_list(model))
    args = model.args.text
    rng = np.random.default_rng(0)
    for i in range(model.first_shared_layer, args.num_hidden_layers):
        prefix = f"language_model.model.layers.{i}.self_attn."
        kv = args.num_key_value_heads * args.head_dim
        weights[prefix + "k_proj.weight"] = mx.array(rng.normal(size=(kv, args.hidden_size)), dtype=mx.float32)
        weights[prefix + "v_proj.weight"] = mx.array(rng.normal(size=(kv, args.hidden_size)), dtype=mx.float32)
        weights[prefix + "k_norm.weight"] = mx.ones((args.head_dim,))
    return weights


def test_mlx_community_names_load_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    """A checkpoint in mlx-community's names and layout (as mlx-vlm converts Gemma 3n: MLX
    convolution layout, unused shared-layer projections included) loads without
    sanitizing and gives the reference's logits."""
    import shutil

    model, _ = loaded(FAMILY, "hub")
    weights = mlx_community_weights(model)
    for name in ("language_model.model.embed_tokens_per_layer.weight",
                 "language_model.model.layers.0.altup.prediction_coefs.weight",
                 "vision_tower.timm_model.conv_stem.conv.weight",
                 "vision_tower.timm_model.blocks.2.1.attn.key.down_conv.weight",
                 "vision_tower.timm_model.msfa.ffn.pw_proj.conv.weight",
                 "embed_vision.embedding_projection.weight", "embed_audio.embedding.weight"):
        assert name in weights, name
    assert not gemma3n.is_hf_checkpoint(weights)
    source = tiny_checkpoints.path(FAMILY, "hub")
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            shutil.copyfile(item, tmp_path / item.name)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "mlx"})
    mlx_model, processor = load(tmp_path)
    _, logits = logits_of(mlx_model, processor, "two_images")
    np.testing.assert_allclose(logits, reference(FAMILY, "two_images").logits, rtol=0, atol=LOGITS_ATOL)


def test_sanitized_names_are_ours(tiny_checkpoints, loaded):
    """transformers 5's saved names and the module tree map onto our (mlx-community's)
    names, convolutions moved to MLX's layout."""
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    reference_model = tiny_checkpoints.model(FAMILY).model
    saved = mx.load(str(tiny_checkpoints.path(FAMILY, "transformers") / "model.safetensors"))
    tree = {k: mx.array(v.numpy()) for k, v in reference_model.state_dict().items()}
    for naming, weights in {"transformers 5": saved, "module tree": tree}.items():
        assert gemma3n.is_hf_checkpoint(weights.keys()), naming
        sanitized = {k: v for k, v in model.sanitize(weights).items()
                     if not gemma3n.is_unused_weight(k, model.first_shared_layer)}
        assert set(sanitized) == expected, naming
    stem = sanitized["vision_tower.timm_model.conv_stem.conv.weight"]
    assert stem.shape == (16, 3, 3, 3) and stem.shape == model.vision_tower.timm_model.conv_stem.conv.weight.shape


def test_prefix_cache_gives_the_tokens_of_a_fresh_prefill(tmp_path, tiny_checkpoints):
    """A conversation's second request reuses the first's cache (trimmed to the shared
    prompt; within the sliding window, here widened to 64, mlx-lm's rotating caches can be
    trimmed): the KV-sharing layers then read a reused cache, and the tokens are those of
    a prefill from scratch. (Past the window the rotating caches cannot be trimmed and
    reuse is off.)"""
    import json
    import shutil

    from mlxvlm.batching import BatchEngine, SamplingOptions
    from mlxvlm.batching.prefix_cache import PrefixCache
    from mlxvlm.prompt import prepare_inputs

    shutil.copytree(tiny_checkpoints.path(FAMILY, "transformers"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["sliding_window"] = window = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, processor = load(tmp_path)
    first = [{"role": "user", "content": "Hello!"}]
    second = first + [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "A cat?"}]

    def run(engine, messages):
        inputs = prepare_inputs(processor, messages, [], feature_names=model.feature_names)
        steps: list = []
        engine.submit(inputs, SamplingOptions(max_tokens=3, temperature=0.0), steps.append)
        while engine.has_work:
            engine.step()
        return [s.token for s in steps], steps[0].cached_tokens, inputs.input_ids.shape[1]

    reusing = BatchEngine(model, processor, prefix_cache=PrefixCache(max_entries=2))
    _, _, first_length = run(reusing, first)
    assert first_length + 3 < window
    tokens, cached, _ = run(reusing, second)
    assert cached > 0
    assert tokens == run(BatchEngine(model, processor), second)[0]


def test_server_answers_an_image_as_transformers_does(loaded, reference):
    """The OpenAI-compatible server takes Gemma 3n's image as a data URL and answers with
    the reference's greedy tokens' text."""
    from server_harness import MODEL_ID, LiveServer, png_data_url, user as url_user

    model, processor = loaded(FAMILY, "transformers")
    expected = processor.tokenizer.decode(reference(FAMILY, "one_image").tokens,
                                          skip_special_tokens=True)
    with LiveServer(model, processor) as live:
        response = live.client().chat.completions.create(
            model=MODEL_ID, messages=[url_user("Describe this image.", png_data_url(IMAGE_A))],
            temperature=0, max_tokens=24,
        )
    assert response.choices[0].message.content == expected
    assert response.usage.prompt_tokens == len(reference(FAMILY, "one_image").input_ids)


def test_a_later_turn_encodes_only_its_new_image(tiny_checkpoints, monkeypatch):
    """The feature cache: the image of an earlier turn is not encoded again, and the
    features it gives back are the tower's (to float32 rounding: an image encoded alone
    or beside another rounds differently; this tiny text model amplifies that past the
    logits tolerance, so the embeddings are compared)."""
    from mlxvlm.models import feature_cache
    from mlxvlm.models.feature_cache import no_feature_cache

    monkeypatch.delenv(feature_cache.ENV_VAR, raising=False)
    model, processor = load(tiny_checkpoints.path(FAMILY, "transformers"))
    calls = []
    original = gemma3n.VisionTower.__call__
    monkeypatch.setattr(gemma3n.VisionTower, "__call__",
                        lambda self, pixels: calls.append(pixels.shape[0]) or original(self, pixels))
    first = CASES["one_image"]
    second = ([*first[0], {"role": "assistant", "content": "A cat."},
               *CASES["image_in_second_turn"][0][-1:]], [IMAGE_A, IMAGE_B])
    embedded(model, processor, *first)
    _, ours, _ = embedded(model, processor, *second)
    assert calls == [1, 1]  # the second turn encoded IMAGE_B alone
    with no_feature_cache():
        _, fresh, _ = embedded(model, processor, *second)
    np.testing.assert_allclose(np.array(ours), np.array(fresh), rtol=0, atol=1e-5)


def test_qlora_on_a_4_bit_conversion(tmp_path, tiny_checkpoints):
    """``mlxvlm.convert`` quantizes the checkpoint to 4 bits; LoRA trains on the quantized
    decoder (QLoRA) and its adapter loads back onto the quantized model, changing it."""
    from finetune_helpers import small_dataset

    from mlxvlm.convert import convert
    from mlxvlm.finetune import FinetuneConfig, finetune

    quantized = tmp_path / "q4"
    convert(str(tiny_checkpoints.path(FAMILY, "hub")), quantized, quantize=True, q_bits=4,
            q_group_size=32)
    base, processor = load(quantized)
    assert "scales" in base.layers[0].self_attn.q_proj  # a quantized layer
    finetune(FinetuneConfig(
        model=str(quantized), data=str(small_dataset(tmp_path / "data", count=4)),
        output=str(tmp_path / "adapter"), method="lora", rank=4, alpha=8, batch_size=2,
        iters=3, learning_rate=1e-2,
    ))
    adapted, _ = load(quantized, adapter_path=tmp_path / "adapter")
    _, before = our_logits(base, processor, *CASES["one_image"])
    _, after = our_logits(adapted, processor, *CASES["one_image"])
    assert np.isfinite(after).all() and np.abs(after - before).max() > 1e-2
