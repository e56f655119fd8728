"""Phi-4-multimodal (transformers' native layout) against transformers (float32), on tiny
random checkpoints (tests/tiny/phi4_multimodal.py) in both layouts, with transformers'
own processors (torchvision's image processor, the torch feature extractor) as the
reference's.

Through ``mlxvlm.load``: first-pass logits and 24 greedy tokens for text only, one image
(2 x 1 crops, the last patch columns padding, and a global view), two images (that one
and a tall one: 1 x 2 crops) and an image in a later turn; audio alone (one
clip; two clips of different lengths, the shorter padded), audio with an image (the
vision-speech projection) and a clip longer than the encoder's 500-step window; LongRoPE
past the original context; a release-style LoRA folder; the CLI (an image and a WAV
file in one prompt, torch-free) and the server (two concurrent requests batched, then a
later turn that reuses the cached prefix); checkpoints in MLX's names; the chat UI's
media kinds. Guards check that the tests can fail.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import wave
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

from av_media import sine, write_audio
from parity import (
    CAUGHT,
    LOGITS_ATOL,
    MIN_REFERENCE_MARGIN,
    NEW_TOKENS,
    assert_another_image_changes_the_output,
    assert_batched_tokens_match,
    assert_decode_steps_match,
    assert_first_pass_matches,
    assert_greedy_tokens_match,
    assert_reference_is_decisive,
    assert_wrong_model_is_caught,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    our_logits,
    our_tokens,
    parameter_list,
    read_config,
    reference_fixture,
    reference_run,
    save_as_mlx_checkpoint,
    standard_cases,
    transformers_logits,
    user,
)
from tiny import make_image
from tiny.phi4_multimodal import (
    HUB_SAMPLING,
    LAYOUTS,
    LONG_FACTOR,
    SHORT_FACTOR,
    reference_processor,
)
from mlxvlm import load, stream_generate
from mlxvlm.models import phi4_multimodal
from mlxvlm.models.feature_cache import no_feature_cache
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

FAMILY = "phi4_multimodal"
IMAGE_A = make_image(100, 60, seed=1)  # 2 x 1 crops of 64 px (padded) + the global view
IMAGE_TALL = make_image(60, 110, seed=2)  # 1 x 2 crops (padded) + the global view
IMAGE_A2 = make_image(100, 60, seed=8)  # A's size, other content (and answer)
IMAGE_NEXT = make_image(50, 40, seed=6)  # the later turn's picture: one crop
SOUND_A = sine(1.0, 16000, 440.0) + sine(1.0, 16000, 1250.0, 0.2)
SOUND_B = sine(0.6, 16000, 900.0)
SOUND_C = sine(1.0, 16000, 250.0)  # A's length, another sound

CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_TALL, IMAGE_A2)

reference = reference_fixture(reference_processor)


def media_turn(*parts, text):
    return [{"role": "user", "content": [*({"type": p} for p in parts),
                                         {"type": "text", "text": text}]}]


AUDIO_CASES = {
    "audio": (media_turn("audio", text="Transcribe the audio to text."), {"audio": [SOUND_A]}),
    "two_audios": (media_turn("audio", "audio", text="Compare the two sounds."),
                   {"audio": [SOUND_A, SOUND_B]}),
    "audio_image": (media_turn("image", "audio", text="What do you see and hear?"),
                    {"image": [IMAGE_A], "audio": [SOUND_A]}),
    "other_audio": (media_turn("audio", text="Transcribe the audio to text."), {"audio": [SOUND_C]}),
}


def greedy_text(processor, tokens) -> str:
    return processor.tokenizer.decode(tokens, skip_special_tokens=True)


def reference_media_run(tiny, messages, media, new_tokens: int = NEW_TOKENS):
    """transformers' processor called as it documents it (``processor(text, images,
    audio)``), its model's first-pass logits and greedy tokens (none without
    ``new_tokens``)."""
    processor = reference_processor(tiny)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], images=media.get("image"), audio=media.get("audio"),
                      sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        logits = tiny.model(**batch).logits[0].numpy()
        if not new_tokens:
            return batch["input_ids"][0].tolist(), logits, [], 0.0
        out = tiny.model.generate(**batch, max_new_tokens=new_tokens, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, batch["input_ids"].shape[1]:].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return batch["input_ids"][0].tolist(), logits, tokens, min(margins)


@pytest.fixture(scope="module")
def audio_reference(tiny_checkpoints):
    """case -> (prompt ids, first-pass logits, greedy tokens, thinnest margin)."""
    return functools.cache(lambda case: reference_media_run(
        tiny_checkpoints.model(FAMILY), *AUDIO_CASES[case]))


def our_media_logits(model, processor, messages, media):
    inputs = prepare_inputs(processor, messages, media.get("image"), audio=media.get("audio"),
                            feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    return inputs.input_ids[0].tolist(), np.array(logits[0])


def our_media_tokens(model, processor, messages, media):
    results = stream_generate(model, processor, messages, image=media.get("image"),
                              audio=media.get("audio"), max_tokens=NEW_TOKENS, temperature=0.0)
    return [r.token for r in results]


# ----------------------------------------------------------------------------- images


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_pass_logits_match_transformers(layout, case, loaded, reference):
    model, processor = loaded(FAMILY, layout)
    assert_first_pass_matches(model, processor, CASES[case], reference(FAMILY, case))


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(case, loaded, reference):
    model, processor = loaded(FAMILY, "hub")
    assert_greedy_tokens_match(model, processor, CASES[case], reference(FAMILY, case))


def test_the_cases_cover_padded_crops_and_global_views(loaded, reference):
    """A (100 x 60) is resized to 106 x 64 on 2 x 1 crops of 64, its last 11 patch columns
    padding: 53 real columns, 27 after pooling, in 16 token rows with a separator each;
    the tall one (60 x 110) to 64 x 117 on 1 x 2 crops, its last 5 patch rows padding:
    30 rows of 16 tokens and a separator. Each image adds one separator and its global
    view's 16 rows of 16 tokens and a separator."""
    model, _ = loaded(FAMILY, "hub")
    ids = np.array(reference(FAMILY, "two_images").input_ids)
    global_view = 1 + 16 * 17
    expected = (16 * 28 + global_view) + (30 * 17 + global_view)
    assert int((ids == model.args.image_token_id).sum()) == expected


def test_decode_steps_match_transformers(tiny_checkpoints, loaded, reference):
    """Teacher-forced on the reference's answer, every decode step gives transformers'
    logits (the answer holds no image placeholder)."""
    model, processor = loaded(FAMILY, "hub")
    ref = reference(FAMILY, "image_in_second_turn")
    assert model.args.image_token_id not in ref.tokens
    assert_decode_steps_match(tiny_checkpoints.model(FAMILY).model, model, processor,
                              CASES["image_in_second_turn"], ref)


def test_batched_generation_gives_each_prompt_its_tokens(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_batched_tokens_match(model, processor, CASES, [reference(FAMILY, c) for c in CASES])


def test_sampling_defaults_come_from_generation_config(loaded):
    _, processor = loaded(FAMILY, "hub")
    assert processor.sampling_defaults.values == HUB_SAMPLING


# ------------------------------------------------------------------------------ audio


@pytest.mark.parametrize("case", ["audio", "two_audios", "audio_image"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_audio_first_pass_logits_match_transformers(layout, case, loaded, audio_reference):
    model, processor = loaded(FAMILY, layout)
    ref_ids, ref_logits, _, _ = audio_reference(case)
    ids, logits = our_media_logits(model, processor, *AUDIO_CASES[case])
    assert ids == ref_ids
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("case", ["audio", "two_audios", "audio_image"])
def test_audio_greedy_tokens_match_transformers(case, loaded, audio_reference):
    model, processor = loaded(FAMILY, "hub")
    _, _, ref_tokens, margin = audio_reference(case)
    assert len(ref_tokens) == NEW_TOKENS and margin > MIN_REFERENCE_MARGIN
    assert our_media_tokens(model, processor, *AUDIO_CASES[case]) == ref_tokens


def test_the_audio_cases_pad_a_clip_and_switch_projections(monkeypatch, loaded, audio_reference):
    """Two clips of different lengths: the processor pads the shorter and sends a mask,
    and each clip fills its own count of placeholders; with an image the vision-speech
    projection is the one that runs (the speech one would give other logits)."""
    model, processor = loaded(FAMILY, "transformers")
    messages, media = AUDIO_CASES["two_audios"]
    inputs = prepare_inputs(processor, messages, audio=media["audio"], feature_names=model.feature_names)
    sizes = np.asarray(inputs.features["audio_embed_sizes"]).tolist()
    assert sizes[0] > sizes[1] and "audio_attention_mask" in inputs.features
    ids = np.array(audio_reference("two_audios")[0])
    assert (ids == model.args.audio_token_id).sum() == sum(sizes)

    original = phi4_multimodal.AudioEmbedding.project
    monkeypatch.setattr(phi4_multimodal.AudioEmbedding, "project",
                        lambda self, states, with_image: original(self, states, False))
    with no_feature_cache():  # features of the patched model must not be kept
        _, logits = our_media_logits(model, processor, *AUDIO_CASES["audio_image"])
    assert np.abs(logits - audio_reference("audio_image")[1]).max() > CAUGHT


def test_a_clip_past_the_encoders_window_matches_transformers(tiny_checkpoints, loaded):
    """41 s: 513 steps after the 8x reduction, folded by transformers into two 500-step
    windows (the second padded) that attend within themselves."""
    model, processor = loaded(FAMILY, "hub")
    clip = sine(41.0, 16000, 330.0) + sine(41.0, 16000, 2000.0, 0.1)
    case = (media_turn("audio", text="Transcribe."), {"audio": [clip]})
    ref_ids, ref_logits, _, _ = reference_media_run(tiny_checkpoints.model(FAMILY), *case, new_tokens=0)
    ids, logits = our_media_logits(model, processor, *case)
    assert ids == ref_ids and (np.array(ids) == model.args.audio_token_id).sum() == 513
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)


def test_another_sound_changes_the_output(loaded, audio_reference):
    model, processor = loaded(FAMILY, "transformers")
    other = our_media_tokens(model, processor, *AUDIO_CASES["other_audio"])
    assert other != audio_reference("audio")[2]
    assert other == audio_reference("other_audio")[2]


# --------------------------------------------------------------------------- LongRoPE


def test_long_factors_past_the_original_context_match_transformers(tmp_path, tiny_checkpoints):
    """With the original context at 16 positions, the prompts are past it: transformers
    computes each in one pass on the long factors, and generates on them. Prefilled here
    in chunks of 8 (the first of which ends within the original context), the greedy
    tokens are still transformers', and so are the logits of one pass."""
    path = tmp_path / "short-original"
    shutil.copytree(tiny_checkpoints.path(FAMILY, "transformers"), path)
    config = json.loads((path / "config.json").read_text())
    config["original_max_position_embeddings"] = 16
    config["rope_parameters"]["original_max_position_embeddings"] = 16
    (path / "config.json").write_text(json.dumps(config))
    model, processor = load(path)
    reference_model = load_transformers_model_causal(path)
    reference_proc = reference_processor(tiny_checkpoints.model(FAMILY))
    cases = {case: CASES[case] for case in ("text", "one_image")}
    references = []
    for messages, images in cases.values():
        ids, logits = our_logits(model, processor, messages, images)
        expected = reference_run(reference_model, reference_proc, messages, images)
        assert len(ids) > 16 and ids == expected.input_ids
        np.testing.assert_allclose(logits, expected.logits, rtol=0, atol=LOGITS_ATOL)
        # (the text prompt's answer ends before 24 tokens: its end-of-turn token included)
        assert expected.margin > MIN_REFERENCE_MARGIN
        assert our_tokens(model, processor, messages, images, prefill_step_size=8) == expected.tokens
        references.append(expected)
    # decoded together: each row on the long factors by its own flag
    assert_batched_tokens_match(model, processor, cases, references)


def test_long_factors_within_the_original_context_would_be_caught(tiny_checkpoints, loaded, reference):
    """mlx-lm's SuScaledRoPE rotates by the long factors at every length: within the
    original context transformers takes the short ones, which the fixture makes differ."""
    assert SHORT_FACTOR != LONG_FACTOR
    config = read_config(tiny_checkpoints, FAMILY, "transformers")
    config["rope_parameters"]["short_factor"] = LONG_FACTOR
    model, processor = loaded(FAMILY, "transformers")
    assert_wrong_model_is_caught(phi4_multimodal.Model.from_config(config), model, processor,
                                 CASES["text"], reference(FAMILY, "text"))


# ---------------------------------------------------------------- the tests can fail


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_another_feature_layer_would_be_caught(tiny_checkpoints, loaded, reference):
    config = read_config(tiny_checkpoints, FAMILY, "transformers")
    config["vision_config"]["feature_layer"] = -1
    model, processor = loaded(FAMILY, "transformers")
    assert_wrong_model_is_caught(phi4_multimodal.Model.from_config(config), model, processor,
                                 CASES["one_image"], reference(FAMILY, "one_image"))


def test_another_streaming_chunk_would_be_caught(tiny_checkpoints, loaded, audio_reference):
    """The fixture's encoder attends in chunks of 4 steps with one chunk of left context;
    the whole clip at once gives other logits."""
    config = read_config(tiny_checkpoints, FAMILY, "transformers")
    config["audio_config"]["chunk_size"] = -1
    model, processor = loaded(FAMILY, "transformers")
    wrong = phi4_multimodal.Model.from_config(config)
    wrong.load_weights(parameter_list(model))
    _, logits = our_media_logits(wrong, processor, *AUDIO_CASES["audio"])
    assert np.abs(logits - audio_reference("audio")[1]).max() > CAUGHT


# ------------------------------------------------------------------------- processors


def test_the_processors_give_transformers_inputs(tiny_checkpoints, loaded):
    """mlxvlm's torch-free image processor and feature extractor give the pixels, masks,
    sizes and log-mel features of transformers' torchvision and torch ones."""
    _, processor = loaded(FAMILY, "hub")
    expected_processor = reference_processor(tiny_checkpoints.model(FAMILY))
    text = "<|user|><|image|><|image|><|audio|><|audio|>Hi<|end|><|assistant|>"
    media = dict(images=[IMAGE_A, IMAGE_TALL], audio=[SOUND_B, SOUND_A], sampling_rate=16000)
    ours = processor(text=text, return_tensors="np", **media)
    theirs = expected_processor(text=text, return_tensors="np", **media)
    assert sorted(ours) == sorted(theirs)
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    for key in ("image_sizes", "image_attention_mask", "audio_embed_sizes", "audio_attention_mask"):
        np.testing.assert_array_equal(ours[key], theirs[key])
    np.testing.assert_allclose(ours["image_pixel_values"], theirs["image_pixel_values"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(ours["audio_input_features"], theirs["audio_input_features"],
                               rtol=1e-6, atol=1e-5)


# ----------------------------------------------------------------------- entry points


# ``python -m MODULE ARGS`` that fails if torch was imported on the way (the processors'
# torch-free twins): the command's own exit status otherwise.
RUN_TORCH_FREE = """
import runpy, sys
module = sys.argv.pop(1)
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
finally:
    imported = {"torch", "torchvision", "torchaudio"} & set(sys.modules)
    assert not imported, f"{sorted(imported)} imported"
"""


def entry_point_env() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MLXVLM_ALLOW_TORCH", None)  # as a user's process runs: torch-free
    return env


def test_cli_answers_an_image_and_a_clip_with_the_reference_tokens(tmp_path, tiny_checkpoints, loaded):
    """``python -m mlxvlm.generate --image a.png --audio a.wav`` on the Hub layout prints
    transformers' greedy answer for the image and the clip (as the WAV stores it) before
    the prompt, without importing torch."""
    _, processor = loaded(FAMILY, "hub")
    picture, clip = tmp_path / "a.png", tmp_path / "a.wav"
    IMAGE_A.save(picture)
    write_audio(clip, SOUND_A, 16000)
    with wave.open(str(clip)) as stored_file:  # the clip as the file stores it
        stored = np.frombuffer(stored_file.readframes(stored_file.getnframes()), "<i2")
    stored = stored.astype(np.float32) / 32768
    _, _, tokens, margin = reference_media_run(
        tiny_checkpoints.model(FAMILY), media_turn("image", "audio", text="Describe this."),
        {"image": [IMAGE_A], "audio": [stored]})
    assert len(tokens) == NEW_TOKENS and margin > MIN_REFERENCE_MARGIN
    result = subprocess.run(
        [sys.executable, "-c", RUN_TORCH_FREE, "mlxvlm.generate",
         "--model", str(tiny_checkpoints.path(FAMILY, "hub")),
         "--image", str(picture), "--audio", str(clip), "--prompt", "Describe this.",
         "--max-tokens", str(NEW_TOKENS), "--temperature", "0"],
        capture_output=True, env=entry_point_env(), timeout=300,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    # bytes: a random model's text may hold a carriage return, which text mode rewrites
    assert result.stdout.decode() == greedy_text(processor, tokens) + "\n"


def test_cli_refuses_a_clip_shorter_than_one_frame(tmp_path, tiny_checkpoints):
    """transformers' feature extractor fails on a clip shorter than its 25 ms window with
    no word why; the command says so in one line."""
    clip = write_audio(tmp_path / "click.wav", sine(0.01, 16000), 16000)
    result = subprocess.run(
        [sys.executable, "-m", "mlxvlm.generate", "--model", str(tiny_checkpoints.path(FAMILY, "hub")),
         "--audio", str(clip), "--prompt", "What is this?", "--max-tokens", "2"],
        capture_output=True, text=True, env=entry_point_env(), timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: an audio clip of 160 samples is shorter than one 25 ms analysis frame "
        "(400 samples at 16000 Hz); send a longer clip")


def test_server_batches_requests_and_reuses_a_turns_prefix(tiny_checkpoints, loaded, reference):
    """The server (in process, on the loaded Hub-layout model): two requests at once (an
    image one and a text one, decoded in one batch) answer with their references' greedy
    text; then a later turn (the first image's conversation, its answer and a new
    picture) reuses the cached prefix and answers as transformers does for the whole
    conversation."""
    from server_harness import MODEL_ID, LiveServer, png_data_url
    from server_harness import user as server_user

    model, processor = loaded(FAMILY, "hub")
    first_turn = [server_user("Describe this image.", png_data_url(IMAGE_A))]
    requests = {"one_image": first_turn,
                "text": [{"role": "user", "content": CASES["text"][0][0]["content"]}]}
    with LiveServer(model, processor) as live:
        client = live.client()

        def ask(messages):
            return client.chat.completions.create(model=MODEL_ID, messages=messages,
                                                  max_tokens=NEW_TOKENS, temperature=0.0)

        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(requests, pool.map(ask, requests.values())))
        for case, answer in answers.items():
            assert answer.choices[0].message.content == greedy_text(
                processor, reference(FAMILY, case).tokens)

        said = answers["one_image"].choices[0].message.content
        later = [*first_turn, {"role": "assistant", "content": said},
                 server_user("And this one?", png_data_url(IMAGE_NEXT))]
        answer = ask(later)
    messages = [*user(None, "Describe this image."), {"role": "assistant", "content": said},
                *user(None, "And this one?")]  # server_user puts images first
    expected = reference_run(tiny_checkpoints.model(FAMILY).model,
                             reference_processor(tiny_checkpoints.model(FAMILY)),
                             messages, [IMAGE_A, IMAGE_NEXT])
    assert_reference_is_decisive(expected)
    assert answer.choices[0].message.content == greedy_text(processor, expected.tokens)
    first_prompt = answers["one_image"].usage.prompt_tokens
    assert answer.usage.prompt_tokens_details.cached_tokens >= first_prompt


# -------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads it into the model the other
    layout's save_pretrained wrote."""
    ref = reference(FAMILY, "one_image")
    processor = reference_processor(tiny_checkpoints.model(FAMILY))
    model = load_transformers_model_causal(tiny_checkpoints.path(FAMILY, "hub"))
    logits = transformers_logits(model, processor, *CASES["one_image"])
    np.testing.assert_array_equal(logits, ref.logits)


def load_transformers_model_causal(path):
    from transformers import Phi4MultimodalForCausalLM

    return Phi4MultimodalForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == new
    assert hub.text.rope_theta == 7_000.0 and hub.text.partial_rotary_factor == 0.75
    assert hub.rope["short_factor"] == SHORT_FACTOR and hub.audio.chunk_size == 4


def test_sanitized_names(tiny_checkpoints, loaded):
    """Both layouts map onto the module tree: the text model under
    ``language_model.model``, the towers under ``image_embed`` and ``audio_embed``,
    convolutions channels-last, the tied head and the tower's pooling head left out."""
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        weights = mx.load(str(tiny_checkpoints.path(FAMILY, layout) / "model.safetensors"))
        assert phi4_multimodal.is_hf_checkpoint(weights.keys())
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected
        assert sanitized["image_embed.img_processor.embeddings.patch_embedding.weight"].shape == (32, 2, 2, 3)
        assert sanitized["audio_embed.encoder.embed.conv.0.weight"].shape == (8, 3, 3, 1)
        assert sanitized["audio_embed.encoder.encoders.0.conv.dw_sep_conv_1d.dw_conv.weight"].shape == (32, 3, 1)
    for name in ("language_model.model.layers.1.self_attn.qkv_proj.weight",
                 "language_model.model.layers.1.mlp.gate_up_proj.weight",
                 "image_embed.global_img_feature_extensor", "image_embed.img_projection_up.bias",
                 "audio_embed.encoder.encoder_embedding.global_invstd",
                 "audio_embed.encoder.relative_attention_bias_layer.bias_values.weight",
                 "audio_embed.encoder.encoders.1.conv.glu.b1",
                 "audio_embed.up_proj_for_vision_speech.weight"):
        assert name in expected, name
    assert "language_model.lm_head.weight" not in expected


def test_an_mlx_layout_checkpoint_loads_unchanged(tmp_path, tiny_checkpoints, loaded, reference):
    model, _ = loaded(FAMILY, "hub")
    mlx_model, processor = load(save_as_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path))
    _, logits = our_logits(mlx_model, processor, *CASES["one_image"])
    np.testing.assert_allclose(logits, reference(FAMILY, "one_image").logits, rtol=0, atol=LOGITS_ATOL)


# ---------------------------------------------------------------------- LoRA adapters


def test_a_release_style_lora_folder_applies_as_transformers_applies_it(tmp_path, tiny_checkpoints,
                                                                         loaded, audio_reference):
    """The release keeps its vision and speech LoRAs as PEFT folders beside the base
    weights (``vision-lora``, ``speech-lora``), which transformers applies with peft
    (``load_adapter(..., adapter_kwargs={"subfolder": ...})`` and ``set_adapter``); a
    ``speech-lora`` of that shape (the text model's qkv_proj, o_proj, gate_up_proj and
    down_proj) loaded here with ``adapter_path`` gives peft's logits for a clip."""
    peft = pytest.importorskip("peft")
    path = tmp_path / "with-lora"
    shutil.copytree(tiny_checkpoints.path(FAMILY, "hub"), path)
    base = load_transformers_model_causal(path)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=r"model\.layers\.\d+\.(self_attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj)")
    torch.manual_seed(5)
    peft.get_peft_model(base, config).save_pretrained(path / "speech-lora")

    # What transformers' load_adapter + set_adapter run (this peft is older than it takes)
    reference_model = peft.PeftModel.from_pretrained(load_transformers_model_causal(path),
                                                     path / "speech-lora").eval()
    messages, media = AUDIO_CASES["audio"]
    processor = reference_processor(tiny_checkpoints.model(FAMILY))
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], audio=media["audio"], sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        expected = reference_model(**batch).logits[0].numpy()
    assert np.abs(expected - audio_reference("audio")[1]).max() > CAUGHT  # the adapter matters

    model, ours = load(path, adapter_path=path / "speech-lora")
    _, logits = our_media_logits(model, ours, messages, media)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=LOGITS_ATOL)


def test_the_chat_ui_offers_images_and_audio(loaded):
    """Phi-4-multimodal's processor names its parts image_processor and audio_processor,
    and its features image_pixel_values and audio_input_features: the chat UI offers
    pictures (and PDF pages) and audio for it."""
    from mlxvlm.ui.media_kinds import supported_kinds

    model, processor = loaded(FAMILY, "hub")
    assert [kind.name for kind in supported_kinds(model, processor)] == ["image", "pdf", "audio"]


def test_longrope_rows_take_their_own_factors(tiny_checkpoints, loaded):
    """A batched pass (one offset per row) with one row marked long and one not: each row
    is rotated on its own factors, as transformers' frequencies and rotation give them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi4_multimodal.modeling_phi4_multimodal import apply_rotary_pos_emb

    from mlxvlm.models.layers.longrope import long_rows

    model, _ = loaded(FAMILY, "transformers")
    rope = model.language_model.model.layers[0].self_attn.rope
    config = tiny_checkpoints.model(FAMILY).model.config
    original = config.rope_parameters["original_max_position_embeddings"]
    x = np.random.default_rng(3).normal(size=(2, 4, 3, 16)).astype(np.float32)
    offsets = [5, 9]
    with long_rows(np.array([True, False])):
        ours = np.array(rope(mx.array(x), offset=mx.array(offsets)))
    for row, (offset, seq_len) in enumerate(zip(offsets, (original + 1, None))):
        inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=seq_len)
        angles = torch.arange(offset, offset + 3, dtype=torch.float32)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)[None]
        cos, sin = angles.cos() * scale, angles.sin() * scale
        expected, _ = apply_rotary_pos_emb(torch.from_numpy(x[row:row + 1]),
                                           torch.from_numpy(x[row:row + 1]), cos, sin)
        np.testing.assert_allclose(ours[row], expected[0].numpy(), rtol=0, atol=1e-5)
    assert np.abs(ours[0] - np.array(rope(mx.array(x[:1]), offset=5))[0]).max() > 1e-2


def test_a_tokenizer_without_the_media_tokens_is_refused(tmp_path, tiny_checkpoints):
    """The processor reads its image and audio tokens off the tokenizer: one that does not
    name them is a clear error at load, not an AttributeError."""
    path = tmp_path / "no-media-tokens"
    shutil.copytree(tiny_checkpoints.path(FAMILY, "hub"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    for name in ("extra_special_tokens", "image_token", "audio_token"):
        config.pop(name, None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="names no image_token or audio_token"):
        phi4_multimodal.load_processor(path, read_config(tiny_checkpoints, FAMILY, "hub"))


def test_the_remote_code_layout_is_refused_naming_the_native_one():
    from mlxvlm.models import UnsupportedModelError, get_family

    with pytest.raises(UnsupportedModelError, match="model_type 'phi4mm'.*phi4_multimodal"):
        get_family("phi4mm")
