"""Gemma 4 against transformers (float32), on tiny random checkpoints.

Two tiny models (see tests/tiny/gemma4.py): ``gemma4``, shaped like the E2B/E4B models
(per-layer inputs, KV shared across the last layers, double-wide MLPs there, soft-capped
logits, clipped and standardized vision tower), and ``gemma4_moe``, shaped like 26B-A4B
(experts beside the dense MLP, keys as values in global layers with their own KV heads,
bidirectional attention among an image's tokens in the sliding layers). Both are loaded
from both config layouts through ``mlxvlm.load`` and compared with the in-memory
transformers model: first-pass logits and greedy tokens for text only, one image, two
images of different sizes and an image in a later turn. Every prompt is longer than the
16-token sliding window. Guards check the tests can fail.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from av_media import sine
from parity import (
    CAUGHT,
    LOGITS_ATOL,
    NEW_TOKENS,
    Reference,
    assert_reference_is_decisive,
    assert_another_image_changes_the_output,
    assert_batched_tokens_match,
    assert_decode_steps_match,
    assert_rotating_cache_keeps_the_prompt,
    assert_wrong_model_is_caught,
    embedded,
    first_pass,
    loaded,  # noqa: F401 (fixture)
    our_logits,
    our_tokens,
    parameter_list,
    read_config,
    reference,  # noqa: F401 (fixture)
    save_as_mlx_checkpoint,
    standard_cases,
    standard_parity_tests,
)
from tiny import make_image
from tiny.gemma4 import FAMILIES, LAYOUTS, SLIDING_WINDOW
from mlxvlm import load
from mlxvlm.models import gemma4
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

IMAGE_A = make_image(112, 84, seed=1)
IMAGE_B = make_image(84, 56, seed=2)
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(
    IMAGE_A, IMAGE_B, IMAGE_A2,
    text="Tell me a story about a red cat on a blue mat.",
    two_images=(None, "and", None, "Compare the two images."),
)
FAMILY_LAYOUTS = [(family, layout) for family in FAMILIES for layout in LAYOUTS]


def tokens_of(model, processor, case, **options):
    return our_tokens(model, processor, *ALL_CASES[case], **options)


# ----------------------------------------------------------------------------------- parity


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests(FAMILY_LAYOUTS, CASES)
)


@pytest.mark.parametrize("case", CASES)
def test_every_prompt_outgrows_the_sliding_window(case, reference):
    assert len(reference("gemma4", case).input_ids) > SLIDING_WINDOW


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_match_transformers(family, tiny_checkpoints, loaded, reference):
    """Teacher-forced on the reference's answer, every decode step (through the rotating
    sliding-window caches and the layers that share another layer's KV) gives
    transformers' logits."""
    model, processor = loaded(family, "hub")
    assert_decode_steps_match(tiny_checkpoints.model(family).model, model, processor,
                              CASES["image_in_second_turn"], reference(family, "image_in_second_turn"))


def test_chunked_prefill_keeps_images_whole(loaded, reference):
    """Where an image's tokens attend both ways, chunks are extended to an image's end."""
    model, processor = loaded("gemma4_moe", "hub")
    assert tokens_of(model, processor, "two_images", prefill_step_size=5) == (
        reference("gemma4_moe", "two_images").tokens
    )


def test_chunked_prefill_through_shared_kv(loaded, reference):
    model, processor = loaded("gemma4", "hub")
    assert tokens_of(model, processor, "image_in_second_turn", prefill_step_size=7) == (
        reference("gemma4", "image_in_second_turn").tokens
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_generation_gives_each_prompt_its_tokens(family, loaded, reference):
    model, processor = loaded(family, "hub")
    assert_batched_tokens_match(model, processor, CASES, [reference(family, c) for c in CASES])


@pytest.mark.parametrize("family", FAMILIES)
def test_rotating_cache_keeps_the_images(family, loaded, reference):
    """--max-kv-size: the global layers' caches rotate but keep the prompt's image tokens."""
    model, processor = loaded(family, "transformers")
    assert_rotating_cache_keeps_the_prompt(model, processor, CASES["one_image"],
                                           reference(family, "one_image"))


# --------------------------------------------------------------------------- thinking


def test_thinking_on_matches_transformers(tiny_checkpoints, loaded, reference):
    """``enable_thinking`` (the Hub template's switch) opens a system turn with <|think|>;
    the prompt and answer are transformers' for it."""
    from parity import with_images

    model, processor = loaded("gemma4", "hub")
    messages, images = CASES["one_image"]
    thinking = {"enable_thinking": True}
    inputs = prepare_inputs(processor, messages, images, feature_names=model.feature_names,
                            chat_template_kwargs=thinking)
    assert "<|think|>" in inputs.prompt_text
    expected = processor.apply_chat_template(
        with_images(messages, images), add_generation_prompt=True, tokenize=True,
        return_dict=True, return_tensors="pt", **thinking,
    )
    ids = inputs.input_ids[0].tolist()
    assert ids == expected["input_ids"][0].tolist()
    assert ids != reference("gemma4", "one_image").input_ids  # thinking off: another prompt
    with torch.no_grad():
        ref_logits = tiny_checkpoints.model("gemma4").model(**expected).logits[0].numpy()
        ref_tokens = tiny_checkpoints.model("gemma4").model.generate(
            **expected, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = first_pass(model, inputs.input_ids, embeddings, state)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    assert our_tokens(model, processor, messages, images, chat_template_kwargs=thinking) == ref_tokens


# ------------------------------------------------------------------------------ audio

SOUND_A = sine(1.0, 16000, 440.0)  # 25 soft tokens over attention windows of 5 frames
SOUND_B = sine(0.7, 16000, 900.0)  # shorter: padded beside A in one batch
SOUND_C = sine(1.0, 16000, 600.0)  # A's length, another pitch


def audio_turn(*parts, text):
    return [{"role": "user", "content": [*({"type": p} for p in parts),
                                         {"type": "text", "text": text}]}]


AUDIO_CASES = {
    "audio": (audio_turn("audio", "audio", text="Listen and tell me a story."),
              {"audio": [SOUND_A, SOUND_B]}),
    "audio_image": (audio_turn("image", "audio", text="Tell me about the picture and the sound."),
                    {"image": [IMAGE_B], "audio": [SOUND_A]}),
    "other_audio": (audio_turn("audio", "audio", text="Listen and tell me a story."),
                    {"audio": [SOUND_C, SOUND_B]}),
}


def with_media(messages, media):
    """The messages with each media part holding its image or samples, in order."""
    sources = {kind: iter(items) for kind, items in media.items()}
    return [{**m, "content": [{**part, part["type"]: next(sources[part["type"]])}
                              if part["type"] in sources else part for part in m["content"]]}
            for m in messages]


@pytest.fixture(scope="module")
def audio_reference(tiny_checkpoints, loaded):
    """case -> transformers' ``Reference``, through ``apply_chat_template(tokenize=True)``."""
    import functools

    @functools.cache
    def run(case):
        messages, media = AUDIO_CASES[case]
        _, processor = loaded("gemma4", "transformers")
        model = tiny_checkpoints.model("gemma4").model
        inputs = processor.apply_chat_template(
            with_media(messages, media), add_generation_prompt=True, tokenize=True,
            return_dict=True, return_tensors="pt",
        )
        with torch.no_grad():
            logits = model(**inputs).logits[0].numpy()
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        return Reference(inputs["input_ids"][0].tolist(), logits, tokens, min(margins))

    return run


def audio_logits(model, processor, messages, media):
    inputs = prepare_inputs(processor, messages, media.get("image"), audio=media.get("audio"),
                            feature_names=model.feature_names)
    assert inputs.num_audios == len(media["audio"])
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    return inputs.input_ids[0].tolist(), np.array(logits[0])


def audio_tokens(model, processor, messages, media, **options):
    return our_tokens(model, processor, messages, media.get("image") or [],
                      audio=media.get("audio"), **options)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["audio", "audio_image"])
def test_audio_matches_transformers(case, layout, loaded, audio_reference):
    model, processor = loaded("gemma4", layout)
    messages, media = AUDIO_CASES[case]
    ref = audio_reference(case)
    ids, logits = audio_logits(model, processor, messages, media)
    assert ids == ref.input_ids
    np.testing.assert_allclose(logits, ref.logits, rtol=0, atol=LOGITS_ATOL)
    assert_reference_is_decisive(ref)
    assert audio_tokens(model, processor, messages, media) == ref.tokens


def test_batched_audio_gives_each_prompt_its_tokens(loaded, audio_reference):
    """batch_generate (the server's engine) takes the sounds and images of each prompt."""
    from mlxvlm import batch_generate

    model, processor = loaded("gemma4", "hub")
    cases = [AUDIO_CASES[c] for c in ("audio", "audio_image")]
    outputs = batch_generate(model, processor, [m for m, _ in cases],
                             [media.get("image") for _, media in cases],
                             audios=[media["audio"] for _, media in cases],
                             max_tokens=NEW_TOKENS, temperature=0.0)
    assert [o.tokens for o in outputs] == [audio_reference(c).tokens for c in ("audio", "audio_image")]


def test_server_takes_images_and_audio(tmp_path, loaded):
    """The OpenAI-style server hears an input_audio part and sees an image_url one, and
    answers as ``generate`` does for the same files."""
    import base64

    from av_media import write_audio
    from server_harness import LiveServer, png_data_url

    from mlxvlm import generate

    model, processor = loaded("gemma4", "hub")
    wav = write_audio(tmp_path / "sound.wav", SOUND_A, 16000)
    text = "Tell me about the picture and the sound."
    expected = generate(model, processor, audio_turn("image", "audio", text=text),
                        image=[IMAGE_B], audio=[wav], max_tokens=12, temperature=0.0)
    content = [
        {"type": "image_url", "image_url": {"url": png_data_url(IMAGE_B)}},
        {"type": "input_audio", "input_audio": {
            "data": base64.b64encode(wav.read_bytes()).decode(), "format": "wav"}},
        {"type": "text", "text": text},
    ]
    with LiveServer(model, processor) as live:
        reply = live.client().chat.completions.create(
            model=live.config.model_id, messages=[{"role": "user", "content": content}],
            max_tokens=12,
            temperature=0.0,
        )
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    assert reply.choices[0].message.content == expected.text


def test_another_sound_changes_the_output(loaded, audio_reference):
    model, processor = loaded("gemma4", "transformers")
    other = audio_tokens(model, processor, *AUDIO_CASES["other_audio"])
    assert other != audio_reference("audio").tokens
    assert other == audio_reference("other_audio").tokens


def test_sound_spans_many_attention_windows(loaded):
    """The clip is far longer than the encoder's attention window, so that the window
    (and the relative positions inside it) decide the features."""
    model, processor = loaded("gemma4", "transformers")
    inputs = prepare_inputs(processor, *AUDIO_CASES["audio_image"][:1], audio=[SOUND_A],
                            image=[IMAGE_B], feature_names=model.feature_names)
    frames = int(np.asarray(inputs.features["input_features_mask"]).sum()) // 4
    assert frames > 4 * (model.args.audio.attention_context_left - 1)


# ----------------------------------------------------------------------- prefix cache


def _engine_tokens(engine, inputs, image):
    from mlxvlm.batching import SamplingOptions
    from mlxvlm.batching.prefix_cache import image_hash

    steps: list = []
    engine.submit(inputs, SamplingOptions(max_tokens=NEW_TOKENS, temperature=0.0), steps.append,
                  image_hashes=[image_hash(image)])
    while engine.has_work:
        engine.step()
    return [s.token for s in steps], steps[0].cached_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_gives_the_tokens_of_a_fresh_prefill(family, loaded):
    """A chat's next turn through an engine with a prefix cache answers exactly as a fresh
    prefill does. Past the sliding window the rotated sliding-layer caches cannot be
    trimmed back to a shorter prefix (mlx-lm's ``can_trim_prompt_cache``), so the entry is
    reusable only whole: a prompt that extends all of it (the first turn's prompt and
    answer, then the next turn) continues from it; one that shares less prefills afresh."""
    from dataclasses import replace

    from mlxvlm.batching import BatchEngine
    from mlxvlm.batching.prefix_cache import PrefixCache

    model, processor = loaded(family, "transformers")
    messages, images = CASES["one_image"]
    first = prepare_inputs(processor, messages, images, feature_names=model.feature_names)
    engine = BatchEngine(model, processor, prefix_cache=PrefixCache(max_entries=2))
    answer, _ = _engine_tokens(engine, first, images[0])
    assert len(engine.prefix_cache) == 1
    held = first.num_tokens + len(answer) - 1  # the answer's last token was never fed
    assert held > SLIDING_WINDOW

    next_turn = processor.tokenizer.encode(
        "<turn|>\n<|turn>user\nTell me more about the colours.<turn|>\n<|turn>model\n",
        add_special_tokens=False)
    ids = [*np.asarray(first.input_ids)[0].tolist(), *answer, *next_turn]
    second = replace(first, input_ids=mx.array([ids], dtype=mx.int32))
    reused, cached = _engine_tokens(engine, second, images[0])
    fresh, none_cached = _engine_tokens(BatchEngine(model, processor), second, images[0])
    assert (cached, none_cached) == (held, 0)
    assert reused == fresh

    # A prompt that shares only part of the entry (the first turn's prompt, another
    # question) cannot cut the rotated caches back to it: it is prefilled afresh.
    other = replace(first, input_ids=mx.array([ids[:first.num_tokens] + next_turn], dtype=mx.int32))
    reused, cached = _engine_tokens(engine, other, images[0])
    assert cached == 0
    assert reused == _engine_tokens(BatchEngine(model, processor), other, images[0])[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_cache_runs_to_the_end(family, loaded, reference):
    """An 8-bit cache for the global layers (the sliding ones keep rotating); the layers
    that share another layer's KV read it dequantized."""
    model, processor = loaded(family, "transformers")
    tokens = tokens_of(model, processor, "two_images", kv_bits=8, kv_group_size=32,
                       quantized_kv_start=0)
    assert len(tokens) == NEW_TOKENS
    assert tokens[:4] == reference(family, "two_images").tokens[:4]


# ---------------------------------------------------------------- the tests can fail


@pytest.mark.parametrize("family", FAMILIES)
def test_another_image_changes_the_output(family, loaded, reference):
    model, processor = loaded(family, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, family, reference)


def test_bidirectional_image_attention_matters(loaded, reference):
    """Run the MoE model's prompt causally (no image blocks): far off the reference."""
    model, processor = loaded("gemma4_moe", "transformers")
    input_ids, embeddings, _ = embedded(model, processor, *CASES["one_image"])
    logits = first_pass(model, input_ids, embeddings, None)
    assert np.abs(logits - reference("gemma4_moe", "one_image").logits).max() > CAUGHT


def _break(config: dict, change: str) -> None:
    text = config["text_config"]
    if change == "no_softcapping":
        text["final_logit_softcapping"] = None
    elif change == "full_rotary":
        text["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 1.0
    elif change == "no_sliding_window":
        text["sliding_window"] = 4096
    elif change == "no_standardize":
        config["vision_config"]["standardize"] = False
    elif change == "no_clipping":
        config["vision_config"]["use_clipped_linears"] = False


@pytest.mark.parametrize("change", ["no_softcapping", "full_rotary", "no_sliding_window",
                                    "no_standardize", "no_clipping"])
def test_config_errors_would_be_caught(change, tiny_checkpoints, loaded, reference):
    config = read_config(tiny_checkpoints, "gemma4", "hub")
    _break(config, change)
    model, processor = loaded("gemma4", "hub")
    wrong = gemma4.Model.from_config(config)
    if change in ("no_standardize", "no_clipping"):
        wrong.load_weights(parameter_list(model), strict=False)
        _, logits = our_logits(wrong, processor, *CASES["one_image"])
        assert np.abs(logits - reference("gemma4", "one_image").logits).max() > CAUGHT
        return
    assert_wrong_model_is_caught(wrong, model, processor, CASES["image_in_second_turn"],
                                 reference("gemma4", "image_in_second_turn"))


def test_per_layer_inputs_of_placeholders_are_the_pad_tokens(loaded, reference):
    """Taking an image token's own per-layer input instead of the pad token's is caught."""
    model, processor = loaded("gemma4", "transformers")
    input_ids, embeddings, state = embedded(model, processor, *CASES["one_image"])
    h = gemma4.run_decoder(model.language_model.model, embeddings, input_ids,
                           model.make_cache(), None)
    logits = np.array(model._head(h)[0])
    assert np.abs(logits - reference("gemma4", "one_image").logits).max() > CAUGHT


# -------------------------------------------------------------- checkpoints and names


@pytest.mark.parametrize("family", FAMILIES)
def test_both_config_layouts_build_the_same_model(family, tiny_checkpoints):
    hub, new = (gemma4.Model.from_config(read_config(tiny_checkpoints, family, layout)).args
                for layout in ("hub", "transformers"))
    assert hub == new


@pytest.mark.parametrize("family", FAMILIES)
def test_sanitized_names_are_mlx_community_names(family, tiny_checkpoints, loaded):
    """transformers' saved names and its module tree map onto mlx-community's names."""
    model, _ = loaded(family, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    reference_model = tiny_checkpoints.model(family).model
    namings = {
        "transformers 5": mx.load(str(tiny_checkpoints.path(family, "transformers") / "model.safetensors")),
        "module tree": {k: mx.array(v.numpy()) for k, v in reference_model.state_dict().items()},
    }
    for naming, weights in namings.items():
        assert gemma4.is_hf_checkpoint(weights.keys()), naming
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected, naming
        assert not gemma4.is_hf_checkpoint(sanitized.keys()), naming
    names = [
        "vision_tower.patch_embedder.input_proj.weight",
        "vision_tower.patch_embedder.position_embedding_table",
        "vision_tower.encoder.layers.1.self_attn.q_proj.linear.weight",
        "vision_tower.encoder.layers.1.self_attn.k_norm.weight",
        "vision_tower.encoder.layers.1.mlp.down_proj.linear.weight",
        "embed_vision.embedding_projection.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.1.self_attn.q_norm.weight",
        "language_model.model.layers.1.layer_scalar",
        "language_model.model.norm.weight",
    ]
    if family == "gemma4":
        names += [
            "vision_tower.encoder.layers.0.mlp.up_proj.input_max",
            "vision_tower.std_bias",
            "language_model.model.embed_tokens_per_layer.weight",
            "language_model.model.per_layer_model_projection.weight",
            "language_model.model.layers.3.per_layer_input_gate.weight",
        ]
        assert "language_model.model.layers.5.self_attn.k_proj.weight" not in expected
    else:
        names += [
            "language_model.model.layers.0.router.proj.weight",
            "language_model.model.layers.0.router.per_expert_scale",
            "language_model.model.layers.0.experts.switch_glu.gate_proj.weight",
            "language_model.model.layers.0.experts.switch_glu.down_proj.weight",
            "language_model.model.layers.0.pre_feedforward_layernorm_2.weight",
        ]
        assert "language_model.model.layers.1.self_attn.v_proj.weight" not in expected
    for name in names:
        assert name in expected, name
    assert "language_model.lm_head.weight" not in expected  # tied


@pytest.mark.parametrize("family", FAMILIES)
def test_an_mlx_layout_checkpoint_loads_unchanged(family, tmp_path, tiny_checkpoints, loaded, reference):
    """A checkpoint saved in our names (mlx-community's) is not sanitized again and gives
    the same logits."""
    model, _ = loaded(family, "hub")
    mlx_model, processor = load(save_as_mlx_checkpoint(model, tiny_checkpoints.path(family, "hub"), tmp_path))
    _, logits = our_logits(mlx_model, processor, *CASES["two_images"])
    np.testing.assert_allclose(logits, reference(family, "two_images").logits, rtol=0, atol=LOGITS_ATOL)
