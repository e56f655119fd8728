"""Qwen2.5-Omni (the thinker) against transformers' Qwen2_5OmniThinkerForConditionalGeneration
on a tiny random checkpoint (tests/tiny/omni.py): logits of the first forward pass
(<= 1e-4) and 24 greedy tokens for audio only (two clips), audio with an image, and a
video with its sound track (TMRoPE's interleaved time chunks); TMRoPE positions against
transformers' get_rope_index on layouts the processor makes; both checkpoint layouts; and
guards that the tests can fail.
"""

from __future__ import annotations

import functools
import json

import mlx.core as mx
import numpy as np
import pytest

from av_media import coloured_frames, sine, write_video
from omni_parity import (
    assert_positions_match_get_rope_index,
    media_logits,
    media_reference_run,
    media_tokens,
    media_turn,
    processor_layouts,
    reference_batch,
)
from parity import LOGITS_ATOL, MIN_REFERENCE_MARGIN, NEW_TOKENS, parameter_list
from tiny import make_image
from tiny.omni import LAYOUTS
from mlxvlm import load, stream_generate
from mlxvlm.media import load_video
from mlxvlm.models import get_family
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

# transformers' processor itself trips numpy's copy-keyword deprecation on torch tensors
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FAMILY = "qwen2_5_omni"
IMAGE = make_image(84, 56, seed=2)
SOUND_A = sine(1.0, 16000, 440.0)  # 100 mel frames: six 16-frame windows and a short one
SOUND_B = sine(0.7, 16000, 900.0)
SOUND_C = sine(1.5, 16000, 600.0)


user = media_turn


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """3 s at 10 fps with a 300 Hz sound track, sampled at 2 fps: 3 frame grids at 0, 1
    and 2 s -> time chunks [0 s, 1 s], [2 s] of video and [0-2 s), [2-3 s] of sound."""
    path = tmp_path_factory.mktemp("omni") / "clip.mp4"
    write_video(path, coloured_frames(30, 64, 48, seed=3), fps=10, audio=sine(3.0, 16000, 300.0))
    return load_video(path, fps=2.0)


def cases(clip):
    return {
        "audio": (user("audio", "audio", text="Listen and tell me a story."),
                  {"audio": [SOUND_A, SOUND_B]}),
        "audio_image": (user("image", "audio", text="Tell me about the picture and the sound."),
                        {"image": [IMAGE], "audio": [SOUND_C]}),
        "video_with_sound": (user("video", text="What do you hear?"), {"video": [clip]}),
        "other_audio": (user("audio", "audio", text="Listen and tell me a story."),
                        {"audio": [SOUND_C, SOUND_B]}),
    }


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
    return functools.cache(lambda layout: load(tiny_checkpoints.path(FAMILY, layout)))


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, loaded, clip):
    """case -> transformers' prompt ids, first-pass logits, greedy tokens, thinnest margin."""

    @functools.cache
    def run(case):
        messages, media = cases(clip)[case]
        _, processor = loaded("transformers")
        return media_reference_run(tiny_checkpoints.model(FAMILY).model, processor,
                                   messages, media)

    return run


our_logits, our_tokens = media_logits, media_tokens


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", ["audio", "audio_image", "video_with_sound"])
def test_logits_and_greedy_tokens_match_transformers(case, loaded, reference, clip):
    model, processor = loaded("transformers")
    messages, media = cases(clip)[case]
    ref_ids, ref_logits, ref_tokens, margin = reference(case)
    inputs, logits = our_logits(model, processor, messages, media)
    assert inputs.input_ids[0].tolist() == ref_ids
    assert inputs.num_audios == len(media.get("audio", []))
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    assert len(ref_tokens) == NEW_TOKENS, "the reference stopped early; pick another prompt"
    assert margin > MIN_REFERENCE_MARGIN, f"top-1/top-2 margin {margin:.2e} is too thin"
    # prefill chunks of 64 tokens cut the interleaved video/audio block
    assert our_tokens(model, processor, messages, media, prefill_step_size=64) == ref_tokens


def test_hub_layout_matches_and_reads_the_same_in_transformers(tiny_checkpoints, loaded,
                                                               reference, clip):
    """The Hub's full-model checkpoint (thinker_config, thinker.*/talker.* tensors, older
    config spellings) loads into the same model; transformers reads it into the same
    thinker, so the fixture is faithful."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model, processor = loaded("hub")
    messages, media = cases(clip)["audio"]
    ref_ids, ref_logits, ref_tokens, _ = reference("audio")
    inputs, logits = our_logits(model, processor, messages, media)
    assert inputs.input_ids[0].tolist() == ref_ids
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    assert our_tokens(model, processor, messages, media) == ref_tokens

    path = tiny_checkpoints.path(FAMILY, "hub")
    full = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    assert full.thinker.config.text_config.rope_parameters["rope_theta"] != 1_000_000.0
    batch, _ = reference_batch(processor, messages, media)
    with torch.no_grad():
        np.testing.assert_array_equal(full.thinker(**batch).logits[0].numpy(), ref_logits)


def test_both_layouts_build_the_same_model(tiny_checkpoints):
    read = lambda layout: json.loads(  # noqa: E731
        (tiny_checkpoints.path(FAMILY, layout) / "config.json").read_text())
    Model = get_family(FAMILY).Model
    assert read("hub")["model_type"] == "qwen2_5_omni"
    assert read("transformers")["model_type"] == "qwen2_5_omni_thinker"
    assert Model.from_config(read("hub")).args == Model.from_config(read("transformers")).args


# --------------------------------------------------------------------------- TMRoPE


def test_positions_match_transformers_get_rope_index(tiny_checkpoints, loaded, clip):
    model, processor = loaded("transformers")
    layouts = processor_layouts(processor, clip, IMAGE, (SOUND_A, SOUND_B, SOUND_C))
    assert_positions_match_get_rope_index(model, tiny_checkpoints.model(FAMILY).model, layouts)


def test_video_seconds_per_grid_follow_the_sampling(loaded, clip):
    """transformers assumes 2 fps for every video; mlxvlm's processor reads each video's
    sampling (1 fps: 2 s per grid of two frames)."""
    _, processor = loaded("transformers")
    slow = load_video(clip.frames[:6], fps=1.0)
    inputs = prepare_inputs(processor, user("video", "video", text="Two."), video=[clip, slow])
    assert np.array(inputs.features["video_second_per_grid"]).tolist() == [1.0, 2.0]


# ---------------------------------------------------------------- the tests can fail


def test_another_audio_changes_the_output(loaded, reference, clip):
    model, processor = loaded("transformers")
    messages, media = cases(clip)["other_audio"]
    tokens = our_tokens(model, processor, messages, media)
    assert tokens == reference("other_audio")[2]
    assert tokens != reference("audio")[2]


def test_sanitized_names(tiny_checkpoints, loaded):
    """Every Hugging Face naming (module tree, save_pretrained's, the Hub's thinker.*) maps
    onto one set: the model's parameters; speech-output tensors are dropped."""
    module = get_family(FAMILY)
    model, _ = loaded("transformers")
    expected = {name for name, _ in parameter_list(model)}
    tree = mx.load(str(tiny_checkpoints.path(FAMILY, "transformers") / "model.safetensors"))
    hub = mx.load(str(tiny_checkpoints.path(FAMILY, "hub") / "model.safetensors"))
    legacy = {k.removeprefix("thinker."): v for k, v in hub.items() if k.startswith("thinker.")}
    assert "talker.codec_head.weight" in hub and "model.layers.0.mlp.up_proj.weight" in legacy
    for weights in (tree, hub, legacy):
        assert module.is_hf_checkpoint(weights)
        sanitized = model.sanitize(weights)
        assert set(sanitized) == expected
        assert not module.is_hf_checkpoint(sanitized)
    for name in ("audio_tower.conv1.weight", "audio_tower.layers.1.self_attn.k_proj.weight",
                 "audio_tower.proj.weight", "vision_tower.blocks.0.attn.qkv.weight",
                 "vision_tower.merger.mlp.2.weight", "language_model.model.norm.weight",
                 "language_model.lm_head.weight"):
        assert name in expected, name
    assert sanitized["audio_tower.conv1.weight"].shape == (32, 3, 128)  # (out, kernel, in)
    assert sanitized["vision_tower.blocks.0.attn.qkv.bias"].shape == (96,)


# --------------------------------------------------------------------------------- CLI


def test_cli_with_audio_image_and_a_video_with_sound(tiny_checkpoints, loaded, clip, tmp_path,
                                                     capsys):
    """The generate CLI places --audio, --image and --video in command-line order, hears
    the video's sound track, and with --verbose says what it sampled."""
    from av_media import write_audio
    from mlxvlm.generate.__main__ import main as run_generate_cli

    sound = write_audio(tmp_path / "sound.wav", SOUND_A, 16000)
    picture = tmp_path / "picture.png"
    IMAGE.save(picture)
    video = write_video(tmp_path / "clip.mp4", coloured_frames(30, 64, 48, seed=3), fps=10,
                        audio=sine(3.0, 16000, 300.0))
    path = tiny_checkpoints.path(FAMILY, "hub")
    code = run_generate_cli(
        ["--model", str(path), "--audio", str(sound), "--image", str(picture), "--video",
         str(video), "--fps", "2", "--prompt", "All of it.", "--max-tokens", "6", "--verbose"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"[mlxvlm] audio '{sound}': 1.00 s, mono 16000 Hz" in err
    assert f"[mlxvlm] video '{video}': 3.00 s at 10 fps, 6 of 30 frames sampled" in err

    model, processor = loaded("hub")
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": str(sound)}, {"type": "image", "image": str(picture)},
        {"type": "video", "video": str(video)}, {"type": "text", "text": "All of it."}]}]
    expected = "".join(r.text for r in stream_generate(model, processor, messages, max_tokens=6))
    assert out == expected + "\n"


def test_rotating_cache_keeps_the_audio_tokens(loaded, clip):
    """With --max-kv-size the cache never evicts media: audio placeholders count."""
    from mlxvlm.errors import PromptTooLongError
    from mlxvlm.generate import make_generation_cache

    model, processor = loaded("transformers")
    messages, media = cases(clip)["audio"]
    inputs = prepare_inputs(processor, messages, audio=media["audio"])
    ids = inputs.input_ids[0].tolist()
    last_audio = max(i for i, t in enumerate(ids) if t == model.args.audio_token_id)
    cache = make_generation_cache(model, inputs, max_kv_size=last_audio + 10)
    assert cache[0].keep == last_audio + 1
    with pytest.raises(PromptTooLongError, match="media"):
        make_generation_cache(model, inputs, max_kv_size=last_audio)
