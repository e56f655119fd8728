"""GLM-4.6V-Flash (``glm4v``, dense) and GLM-4.6V (``glm4v_moe``) against transformers
(float32, PIL processor), on tiny random checkpoints in both layouts (tests/tiny/glm4v.py).

Parity: first-pass logits within 1e-4 and 24 greedy tokens for text, one image, two
images of different aspect ratios and an image in a later turn, through
``mlxvlm.stream_generate``; decode steps, chunked prefill; the same answer through the
CLI's ``main``, the batching engine and two concurrent requests to ``python -m
mlxvlm.server``; a later turn's request reusing the server's cached prefix; thoughts
apart from the answer; video frames inside a video block placed as transformers places
them (the video processor: test_glm4v_video.py).
Guards show the tests can fail: another image changes the answer, and a wrong rope θ,
the other head rotation, or a position table not resampled move the logits far away.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from parity import (
    CAUGHT,
    LOGITS_ATOL,
    NEW_TOKENS,
    assert_another_image_changes_the_output,
    assert_batched_tokens_match,
    assert_decode_steps_match,
    assert_wrong_model_is_caught,
    load_transformers_model,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    our_logits,
    our_tokens,
    parameter_list,
    read_config,
    reference_fixture,
    save_as_mlx_checkpoint,
    standard_cases,
    standard_parity_tests,
    transformers_logits,
)
from tiny import make_image
from tiny.glm4v import FAMILIES, LAYOUTS, reference_processor
from mlxvlm import load
from mlxvlm.models import get_family

torch = pytest.importorskip("torch")

IMAGE_A = make_image(112, 84, seed=1)  # 6 x 8 patches of 14 px -> 12 tokens
IMAGE_B = make_image(56, 98, seed=2)  # a tall one: 7 x 4 patches resized to 8 x 4 -> 8 tokens
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_B, IMAGE_A2)
FAMILY_LAYOUTS = [(f, layout) for f in FAMILIES for layout in LAYOUTS]

# The reference runs on transformers' processor built from the tiny model's own parts.
reference = reference_fixture(reference_processor)

test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests(FAMILY_LAYOUTS, CASES)
)


def reference_text(processor, ref) -> str:
    return processor.tokenizer.decode(ref.tokens, skip_special_tokens=True)


def without_think_tags(text: str) -> str:
    return text.replace("<think>", "").replace("</think>", "")


def answer_text(answer) -> str:
    """A chat completion's reasoning and content, as one text without the thinking tags
    (the server splits an answer at the template's <think> ... </think>)."""
    message = answer.choices[0].message
    return without_think_tags((getattr(message, "reasoning_content", None) or "")
                              + (message.content or ""))


# --------------------------------------------------------------------- entry points


def test_cli_prints_the_reference_answer(tmp_path, capsys, tiny_checkpoints, reference):
    """``python -m mlxvlm.generate``'s main: a picture file and a prompt, greedy."""
    from mlxvlm.generate.__main__ import main

    image = tmp_path / "picture.png"
    IMAGE_A.save(image)
    path = tiny_checkpoints.path("glm4v", "hub")
    code = main(["--model", str(path), "--image", str(image), "--prompt", "Describe this image.",
                 "--max-tokens", str(NEW_TOKENS), "--temperature", "0"])
    assert code in (0, None)
    _, processor = load(path)
    expected = reference_text(processor, reference("glm4v", "one_image"))
    assert capsys.readouterr().out.rstrip("\n") == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_generation_gives_each_prompt_its_tokens(family, loaded, reference):
    """The batching engine decodes the four prompts together (rows of different lengths
    and M-RoPE deltas): each keeps its reference's tokens."""
    model, processor = loaded(family, "hub")
    assert_batched_tokens_match(model, processor, CASES, [reference(family, c) for c in CASES])


@pytest.fixture(scope="module")
def server(loaded):
    from server_harness import LiveServer

    with LiveServer(*loaded("glm4v", "hub")) as live:
        yield live


def chat(server, messages):
    return server.client().chat.completions.create(
        model=server.config.model_id, messages=messages, max_tokens=NEW_TOKENS, temperature=0.0)


def test_two_concurrent_requests_to_the_server_entry_point(tiny_checkpoints, loaded, reference):
    """``python -m mlxvlm.server`` as users start it: an image request and a text one in
    flight at once (one batched decode) answer with their references' text."""
    from concurrent.futures import ThreadPoolExecutor

    from server_harness import png_data_url, user
    from server_process import ServerProcess

    _, processor = loaded("glm4v", "hub")
    requests = {
        "one_image": [user("Describe this image.", png_data_url(IMAGE_A))],
        "text": [{"role": "user", "content": CASES["text"][0][0]["content"]}],
    }
    with ServerProcess("--model", str(tiny_checkpoints.path("glm4v", "hub")),
                       "--served-model-name", "glm") as server:
        client = server.openai_client()

        def ask(messages):
            return client.chat.completions.create(model="glm", messages=messages,
                                                  max_tokens=NEW_TOKENS, temperature=0.0)

        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(requests, pool.map(ask, requests.values())))
    for case, answer in answers.items():
        ref = reference("glm4v", case)
        assert answer_text(answer) == without_think_tags(reference_text(processor, ref))
        assert answer.usage.prompt_tokens == len(ref.input_ids)


def test_thoughts_come_back_apart_from_the_answer(server, loaded, monkeypatch):
    """The template teaches <think>: an answer that thinks first (scripted tokens through
    the real engine) returns its thoughts as ``reasoning_content``."""
    from scripted_tokens import script_tokens
    from server_harness import png_data_url, user

    from mlxvlm.text.answer_parts import THINK, think_format

    _, processor = loaded("glm4v", "hub")
    assert think_format(processor.chat_template) == THINK
    tokenizer = processor.tokenizer
    script_tokens(monkeypatch, tokenizer.encode("<think>A cat.</think>\nThe cat is red.")
                  + [tokenizer.convert_tokens_to_ids("<|user|>")])
    message = chat(server, [user("Describe this image.", png_data_url(IMAGE_A))]).choices[0].message
    assert (message.reasoning_content, message.content) == ("A cat.", "The cat is red.")


def test_later_turn_with_an_image_reuses_the_prefix(server, loaded, reference):
    """The second request repeats the first's turn and adds an image turn: the cached
    prefix is reused and the answer is transformers' for the whole conversation."""
    from server_harness import png_data_url, user

    _, processor = loaded("glm4v", "hub")
    messages, images = CASES["image_in_second_turn"]
    first = chat(server, [messages[0]])
    later = [messages[0], messages[1], user("What is in this picture?", png_data_url(images[0]))]
    answer = chat(server, later)
    assert answer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert answer_text(answer) == without_think_tags(
        reference_text(processor, reference("glm4v", "image_in_second_turn")))


def test_sampling_defaults_come_from_generation_config(tiny_checkpoints, loaded):
    _, processor = loaded("glm4v", "hub")
    written = json.loads((tiny_checkpoints.path("glm4v", "hub") / "generation_config.json").read_text())
    defaults = processor.sampling_defaults.values
    assert {k: defaults[k] for k in ("temperature", "top_p", "top_k")} == {
        k: written[k] for k in ("temperature", "top_p", "top_k")}


def test_thinking_off_matches_transformers(tiny_checkpoints, loaded, reference):
    """``enable_thinking=False`` (the template adds /nothink and an empty thinking block)
    gives another prompt, and transformers' tokens for it."""
    from parity import assert_reference_is_decisive, reference_run

    from mlxvlm.prompt import prepare_inputs

    model, processor = loaded("glm4v", "hub")
    off = {"enable_thinking": False}
    ref = reference_run(tiny_checkpoints.model("glm4v").model, reference_processor(
        tiny_checkpoints.model("glm4v")), *CASES["one_image"], **off)
    inputs = prepare_inputs(processor, *CASES["one_image"], chat_template_kwargs=off)
    assert inputs.input_ids[0].tolist() == ref.input_ids != reference("glm4v", "one_image").input_ids
    assert_reference_is_decisive(ref)
    assert our_tokens(model, processor, *CASES["one_image"], chat_template_kwargs=off) == ref.tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_match_transformers(family, tiny_checkpoints, loaded, reference):
    """Teacher-forced on the reference's answer, each decode step's logits are the ones
    transformers computes for it in one pass (M-RoPE after the prompt)."""
    model, processor = loaded(family, "hub")
    assert_decode_steps_match(tiny_checkpoints.model(family).model, model, processor,
                              CASES["two_images"], reference(family, "two_images"))


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_gives_the_same_tokens(family, loaded, reference):
    """Chunks of 5 tokens cut through the images' runs."""
    model, processor = loaded(family, "hub")
    assert our_tokens(model, processor, *CASES["two_images"], prefill_step_size=5) == (
        reference(family, "two_images").tokens)


def test_glm41v_processor_checkpoints_take_images(tmp_path, tiny_checkpoints, reference):
    """A checkpoint naming GLM-4.1V's ``Glm4vProcessor`` gets it, and the same image
    answer (its videos: test_glm4v_video.py)."""
    import shutil

    copy = tmp_path / "glm41v"
    shutil.copytree(tiny_checkpoints.path("glm4v", "hub"), copy)
    settings = json.loads((copy / "preprocessor_config.json").read_text())
    settings.update(processor_class="Glm4vProcessor", image_processor_type="Glm4vImageProcessor")
    (copy / "preprocessor_config.json").write_text(json.dumps(settings))
    model, processor = load(copy)
    assert type(processor).__name__ == "Glm4vProcessor"
    ref = reference("glm4v", "one_image")
    assert our_tokens(model, processor, *CASES["one_image"]) == ref.tokens


# ----------------------------------------------------------------------------- video


@pytest.mark.parametrize("family", FAMILIES)
def test_video_frames_in_a_video_block_match_transformers(family, tiny_checkpoints, loaded):
    """A 2-frame video prompted as GLM-V does (each frame an image block of image tokens
    followed by its timestamp, all inside <|begin_of_video|> ... <|end_of_video|>): the
    frames take the video's features and one 1 x h x w grid each. (Alone: transformers
    5.25 scatters image features over a video's frame tokens too when both come.)"""
    model, processor = loaded(family, "transformers")
    assert_video_block_matches_transformers(tiny_checkpoints.model(family).model, model, processor)


def assert_video_block_matches_transformers(reference_model, model, processor) -> None:
    """A 2-frame video as GLM-V prompts it: our logits are transformers' (GLM-OCR's
    parity tests reuse it)."""
    tok = processor.tokenizer
    ids_of = tok.convert_tokens_to_ids
    image, begin, end = ids_of("<|image|>"), ids_of("<|begin_of_image|>"), ids_of("<|end_of_image|>")
    ids = tok.encode("Now the clip:") + [ids_of("<|begin_of_video|>")]
    for seconds in ("0.0 seconds", "1.0 seconds"):
        ids += [begin] + [image] * 6 + [end] + tok.encode(seconds)
    ids += [ids_of("<|end_of_video|>")] + tok.encode("What happens?")
    rng = np.random.default_rng(0)
    patch = 3 * 2 * 14 * 14
    features = {
        "pixel_values_videos": rng.normal(size=(48, patch)).astype(np.float32),
        "video_grid_thw": np.array([[2, 4, 6]]),
    }
    token_types = processor.create_mm_token_type_ids([ids])
    with torch.no_grad():
        ref_logits = reference_model(
            input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor(token_types),
            **{k: torch.from_numpy(v) for k, v in features.items()},
        ).logits[0].numpy()
    input_ids = mx.array([ids], dtype=mx.int32)
    embeddings, state = model.embed(input_ids, **{k: mx.array(v) for k, v in features.items()})
    logits = model(input_ids, model.make_cache(), embeddings=embeddings, state=state)
    np.testing.assert_allclose(np.array(logits[0]), ref_logits, rtol=0, atol=LOGITS_ATOL)


# ---------------------------------------------------------------- the tests can fail


@pytest.mark.parametrize("family", FAMILIES)
def test_another_image_changes_the_output(family, loaded, reference):
    model, processor = loaded(family, "hub")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, family, reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_rope_theta_would_be_caught(family, tiny_checkpoints, loaded, reference):
    config = read_config(tiny_checkpoints, family, "hub")
    del config["text_config"]["rope_theta"]  # what a loader reading rope_parameters sees
    model, processor = loaded(family, "hub")
    assert_wrong_model_is_caught(get_family(family).Model.from_config(config), model, processor,
                                 CASES["image_in_second_turn"], reference(family, "image_in_second_turn"))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_other_head_rotation_would_be_caught(family, tiny_checkpoints, loaded, reference):
    """Pairs (GLM-4V) and halves (GLM-4.5V) rotate differently: swapping them is caught."""
    model, processor = loaded(family, "hub")
    wrong = get_family(family).Model.from_config(read_config(tiny_checkpoints, family, "hub"))
    for layer in wrong.language_model.model.layers:
        layer.self_attn.pairs = not layer.self_attn.pairs
    assert_wrong_model_is_caught(wrong, model, processor, CASES["one_image"],
                                 reference(family, "one_image"))


def test_the_position_table_must_be_resampled(loaded, reference):
    """Positions taken from the table's nearest cell instead of its bicubic resampling
    move the image's logits far away."""
    from mlxvlm.models.layers import glm_vision

    model, processor = loaded("glm4v", "hub")
    ref = reference("glm4v", "two_images")
    original = glm_vision.bicubic_position_taps

    def nearest(grid_thw, merge, side):
        indices, weights = original(grid_thw, merge, side)
        keep = weights.argmax(axis=1)
        rows = np.arange(len(keep))
        return indices[rows, keep][:, None], np.ones((len(keep), 1), np.float32)

    model.feature_cache.clear()
    glm_vision.bicubic_position_taps = nearest
    try:
        _, logits = our_logits(model, processor, *CASES["two_images"])
    finally:
        glm_vision.bicubic_position_taps = original
        model.feature_cache.clear()
    assert np.abs(logits - ref.logits).max() > CAUGHT


# -------------------------------------------------------------- checkpoints and names


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_layout_reads_the_same_in_transformers(family, tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it into the same model."""
    path = tiny_checkpoints.path(family, "hub")
    processor = get_family(family).load_processor(path, {})
    logits = transformers_logits(load_transformers_model(path), processor, *CASES["one_image"])
    np.testing.assert_allclose(logits, reference(family, "one_image").logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_both_config_layouts_build_the_same_model(family, tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, family)
    assert hub == new
    assert new.text.rope_theta == 5000.0 and new.text.rotary_dim == 16
    assert new.text.rotate_pairs == (family == "glm4v")
    assert new.text.is_moe == (family == "glm4v_moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_sanitized_names_are_mlx_community_names(family, tiny_checkpoints, loaded):
    module = get_family(family)
    model, _ = loaded(family, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        path = tiny_checkpoints.path(family, layout)
        weights = mx.load(str(path / "model.safetensors"))
        assert module.is_hf_checkpoint(weights.keys())
        sanitized = module.Model.from_config(read_config(tiny_checkpoints, family, layout)).sanitize(weights)
        assert set(sanitized) == expected, layout
        assert not module.is_hf_checkpoint(sanitized.keys())
    names = [
        "vision_tower.patch_embed.proj.weight",
        "vision_tower.post_conv_layernorm.weight",
        "vision_tower.embeddings.position_embedding.weight",
        "vision_tower.blocks.1.attn.qkv.weight",
        "vision_tower.blocks.1.mlp.gate_proj.weight",
        "vision_tower.downsample.weight",
        "vision_tower.merger.post_projection_norm.bias",
        "language_model.model.layers.0.self_attn.q_proj.bias",
        "language_model.lm_head.weight",
    ]
    if family == "glm4v_moe":
        names += [
            "language_model.model.layers.0.mlp.gate_proj.weight",  # first_k_dense_replace
            "language_model.model.layers.1.mlp.gate.e_score_correction_bias",
            "language_model.model.layers.1.mlp.switch_mlp.gate_proj.weight",
            "language_model.model.layers.1.mlp.shared_experts.down_proj.weight",
        ]
        assert not any(name.startswith("language_model.model.layers.2.") for name in expected)
    else:
        names += ["language_model.model.layers.1.mlp.gate_up_proj.weight",
                  "language_model.model.layers.1.post_mlp_layernorm.weight"]
    for name in names:
        assert name in expected, name
    assert sanitized["vision_tower.downsample.weight"].shape == (128, 2, 2, 32)  # channels last


@pytest.mark.parametrize("family", FAMILIES)
def test_an_mlx_layout_checkpoint_loads_unchanged(family, tmp_path, tiny_checkpoints, loaded, reference):
    """What mlx-community publishes (our names, ``format: mlx``) loads as it is."""
    model, _ = loaded(family, "hub")
    mlx_model, processor = load(save_as_mlx_checkpoint(model, tiny_checkpoints.path(family, "hub"), tmp_path))
    _, logits = our_logits(mlx_model, processor, *CASES["two_images"])
    np.testing.assert_allclose(logits, reference(family, "two_images").logits, rtol=0, atol=LOGITS_ATOL)


def test_moe_router_bias_matters(tiny_checkpoints, loaded, reference):
    """The router's score-correction bias picks experts: without it the logits move."""
    model, processor = loaded("glm4v_moe", "hub")
    wrong = get_family("glm4v_moe").Model.from_config(read_config(tiny_checkpoints, "glm4v_moe", "hub"))
    wrong.load_weights(parameter_list(model))
    for layer in wrong.language_model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias = mx.zeros_like(layer.mlp.gate.e_score_correction_bias)
    _, logits = our_logits(wrong, processor, *CASES["one_image"])
    assert np.abs(logits - reference("glm4v_moe", "one_image").logits).max() > CAUGHT


def test_a_bfloat16_conversion_keeps_the_router_bias_in_float32(tmp_path, tiny_checkpoints):
    from mlxvlm.convert import convert

    convert(str(tiny_checkpoints.path("glm4v_moe", "hub")), tmp_path / "bf16", dtype="bfloat16")
    saved = {}
    for shard in (tmp_path / "bf16").glob("*.safetensors"):
        saved.update(mx.load(str(shard)))
    dtypes = {name: value.dtype for name, value in saved.items()}
    assert dtypes["language_model.model.layers.1.mlp.gate.e_score_correction_bias"] == mx.float32
    assert dtypes["language_model.model.layers.1.mlp.gate.weight"] == mx.bfloat16


def test_glm_ocr_style_switches_build(tiny_checkpoints):
    """The tower's and the decoder's GLM-OCR switches build the modules GLM-OCR's
    checkpoints name (no position table, q/k norms and biases in the tower; no attention
    biases in the decoder)."""
    from mlxvlm.models.layers.glm_decoder import GlmLanguageModel, GlmTextConfig
    from mlxvlm.models.layers.glm_vision import GlmVisionConfig, GlmVisionTransformer

    config = read_config(tiny_checkpoints, "glm4v", "transformers")
    vision = GlmVisionConfig.from_hf(config["vision_config"], attention_bias=True,
                                     projection_biases=True, learned_positions=False,
                                     qk_norm=True, mlp_width=64)
    names = {name for name, _ in parameter_list(GlmVisionTransformer(vision))}
    assert {"blocks.0.attn.q_norm.weight", "blocks.0.attn.proj.bias",
            "blocks.0.mlp.up_proj.bias"} <= names
    assert not any(name.startswith(("embeddings.", "post_conv_layernorm.")) for name in names)
    text = GlmTextConfig.from_hf(config, moe=False, attention_bias=False)
    names = {name for name, _ in parameter_list(GlmLanguageModel(text))}
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any(name.endswith("_proj.bias") for name in names)
