"""Qwen3-Omni (the thinker) against transformers' Qwen3OmniMoeThinkerForConditionalGeneration
on a tiny random checkpoint (tests/tiny/qwen3_omni.py): logits of the first forward pass
(<= 1e-4) and 24 greedy tokens for text, one image, two images and an image in a later
turn in both checkpoint layouts, and for audio (two sounds, one spanning two attention
windows), audio with an image, a video, and a video with its sound track (TMRoPE's
token-by-token merge); positions against transformers' get_rope_index on layouts the
processor makes; checkpoint names; and guards that the tests can fail.
"""

from __future__ import annotations

import functools

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
)
from parity import (
    LOGITS_ATOL,
    MIN_REFERENCE_MARGIN,
    NEW_TOKENS,
    assert_another_image_changes_the_output,
    loaded,  # noqa: F401 (fixture)
    model_args_in_both_layouts,
    parameter_list,
    read_config,
    reference,  # noqa: F401 (fixture)
    standard_cases,
    standard_parity_tests,
    transformers_logits,
)
from tiny import make_image
from tiny.qwen3_omni import LAYOUTS
from mlxvlm.media import load_video
from mlxvlm.media.frame_sampling import sampler_for
from mlxvlm.models import get_family

torch = pytest.importorskip("torch")

# transformers' processor itself trips numpy's copy-keyword deprecation on torch tensors
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FAMILY = "qwen3_omni_moe"
IMAGE_A = make_image(112, 84, seed=1)
IMAGE_B = make_image(84, 56, seed=2)
IMAGE_A2 = make_image(112, 84, seed=3)  # A's size, other content
CASES, ALL_CASES = standard_cases(IMAGE_A, IMAGE_B, IMAGE_A2)
FAMILY_LAYOUTS = [(FAMILY, layout) for layout in LAYOUTS]

SOUND_A = sine(2.5, 16000, 440.0)  # 250 mel frames: 3 chunks, 33 tokens in 2 windows
SOUND_B = sine(0.7, 16000, 900.0)
SOUND_C = sine(1.5, 16000, 600.0)


# ---------------------------------------------------------------- text and images


test_first_pass_logits_match_transformers, test_greedy_tokens_match_transformers = (
    standard_parity_tests(FAMILY_LAYOUTS, CASES)
)


def test_another_image_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    assert_another_image_changes_the_output(model, processor, ALL_CASES, FAMILY, reference)


def test_deepstack_matters(loaded, reference):
    """Dropping the DeepStack rows moves the logits far from the reference: the parity
    above exercises them."""
    import dataclasses

    from parity import embedded, first_pass

    model, processor = loaded(FAMILY, "transformers")
    input_ids, embeddings, state = embedded(model, processor, *CASES["two_images"])
    assert state.deepstack is not None and len(state.deepstack.layers) == 1
    without = dataclasses.replace(state, deepstack=None)
    ref_logits = reference(FAMILY, "two_images").logits
    assert np.abs(first_pass(model, input_ids, embeddings, without) - ref_logits).max() > 0.1


# ------------------------------------------------------------------ audio and video


@pytest.fixture(scope="module")
def clips(tmp_path_factory, loaded):
    """3 s at 10 fps, sampled at 2 fps as the family's video processor samples: 3 frame
    grids at 0, 1 and 2 s (positions 0, 13, 26); one with a 300 Hz sound track (39 audio
    tokens merged among the frames), one silent."""
    root = tmp_path_factory.mktemp("qwen3-omni")
    frames = coloured_frames(30, 64, 48, seed=3)
    sound = write_video(root / "sound.mp4", frames, fps=10, audio=sine(3.0, 16000, 300.0))
    silent = write_video(root / "silent.mp4", coloured_frames(30, 64, 48, seed=4), fps=10)
    sampler = sampler_for(loaded(FAMILY, "transformers")[1].video_processor)
    clips = {name: load_video(path, fps=2.0, sampler=sampler)
             for name, path in (("sound", sound), ("silent", silent))}
    # 4 frames of 3 s: grids 1.5 s apart, at positions 0 and 19.5 (transformers keeps
    # them fractional), and everything after them too
    clips["sound_slow"] = load_video(sound, fps=1.5, sampler=sampler)
    return clips


def test_frames_are_sampled_as_transformers_qwen2_vl_video_processor_does(loaded, clips):
    """transformers maps qwen3_omni_moe to Qwen2VLVideoProcessor, whose sample_frames
    takes frames one even step apart from the first (tests/test_frame_sampling.py checks
    the sampler against it)."""
    from mlxvlm.media.frame_sampling import QwenStepSampler

    assert type(sampler_for(loaded(FAMILY, "transformers")[1].video_processor)) is QwenStepSampler
    assert clips["sound"].frame_indices.tolist() == [0, 5, 10, 15, 20, 25]


def media_cases(clips):
    return {
        "audio": (media_turn("audio", "audio", text="Tell me a story about the sounds."),
                  {"audio": [SOUND_A, SOUND_B]}),
        "audio_image": (media_turn("image", "audio",
                                   text="Tell me about the picture and the sound."),
                        {"image": [IMAGE_A], "audio": [SOUND_C]}),
        "video": (media_turn("video", text="What happens in the video?"),
                  {"video": [clips["silent"]]}),
        "video_with_sound": (media_turn("video", text="What do you hear?"),
                             {"video": [clips["sound"]]}),
        "slow_video_with_sound": (media_turn("video", text="What do you hear?"),
                                  {"video": [clips["sound_slow"]]}),
        "other_audio": (media_turn("audio", "audio", text="Tell me a story about the sounds."),
                        {"audio": [SOUND_C, SOUND_B]}),
    }


@pytest.fixture(scope="module")
def media_reference(tiny_checkpoints, loaded, clips):
    """case -> transformers' ``Reference``."""

    @functools.cache
    def run(case):
        messages, media = media_cases(clips)[case]
        _, processor = loaded(FAMILY, "transformers")
        return media_reference_run(tiny_checkpoints.model(FAMILY).model, processor,
                                   messages, media)

    return run


@pytest.mark.parametrize("case", ["audio", "audio_image", "video", "video_with_sound",
                                  "slow_video_with_sound"])
def test_media_logits_and_greedy_tokens_match_transformers(case, loaded, media_reference, clips):
    model, processor = loaded(FAMILY, "transformers")
    messages, media = media_cases(clips)[case]
    ref_ids, ref_logits, ref_tokens, margin = media_reference(case)
    inputs, logits = media_logits(model, processor, messages, media)
    assert inputs.input_ids[0].tolist() == ref_ids
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    assert len(ref_tokens) == NEW_TOKENS, "the reference stopped early; pick another prompt"
    assert margin > MIN_REFERENCE_MARGIN, f"top-1/top-2 margin {margin:.2e} is too thin"
    # prefill chunks of 16 tokens cut the media blocks (and DeepStack's rows)
    assert media_tokens(model, processor, messages, media, prefill_step_size=16) == ref_tokens


def test_fractional_positions_stay_fractional(loaded, clips):
    """A video whose frame grids fall between integer positions: the prompt's positions
    are fractional (as transformers keeps them), the tokens after the prompt continue
    from them, and a fractional rope delta carries into batched decoding."""
    from mlxvlm.models.layers.mrope_decoder import MRopeState

    model, processor = loaded(FAMILY, "transformers")
    messages, media = media_cases(clips)["slow_video_with_sound"]
    inputs, _ = media_logits(model, processor, messages, media)
    _, state = model.embed(inputs.input_ids, **inputs.features)
    ids = np.array(state.position_ids)
    # the second frame grid, 1.5 s x 13 after the first
    assert state.position_ids.dtype == mx.float32 and (ids[0] % 1 == 0.5).any()
    prompt = ids.shape[1]
    assert np.array(state.positions(prompt - 1, 2)).tolist() == [
        [ids[axis, -1], prompt + state.rope_delta] for axis in range(3)]
    half = MRopeState(mx.zeros((3, 2)), 0.5)
    batch = MRopeState.batch([half, None])
    assert batch.positions(mx.array([2, 3]), 1)[:, 0, 0].tolist() == [2.5, 3]


def test_hub_layout_takes_audio_and_video_alike(loaded, media_reference, clips):
    model, processor = loaded(FAMILY, "hub")
    messages, media = media_cases(clips)["video_with_sound"]
    ref_ids, ref_logits, ref_tokens, _ = media_reference("video_with_sound")
    inputs, logits = media_logits(model, processor, messages, media)
    assert inputs.input_ids[0].tolist() == ref_ids
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    assert media_tokens(model, processor, messages, media) == ref_tokens


def test_another_audio_changes_the_output(loaded, media_reference, clips):
    model, processor = loaded(FAMILY, "transformers")
    messages, media = media_cases(clips)["other_audio"]
    tokens = media_tokens(model, processor, messages, media)
    assert tokens == media_reference("other_audio")[2]
    assert tokens != media_reference("audio")[2]


def test_positions_match_transformers_get_rope_index(tiny_checkpoints, loaded, clips):
    model, processor = loaded(FAMILY, "transformers")
    layouts = [*processor_layouts(processor, clips["silent"], IMAGE_A, (SOUND_A, SOUND_B, SOUND_C)),
               *processor_layouts(processor, clips["sound_slow"], IMAGE_B, (SOUND_C, SOUND_A, SOUND_B))]
    assert_positions_match_get_rope_index(model, tiny_checkpoints.model(FAMILY).model, layouts)


# ------------------------------------------------------------- checkpoints and names


def test_hub_layout_reads_the_same_in_transformers(tiny_checkpoints, reference):
    """The Hub-layout fixture is faithful: transformers reads the full model's thinker
    (thinker.*, one tensor per expert, speech output beside it) into the same model."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    path = tiny_checkpoints.path(FAMILY, "hub")
    full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    assert full.thinker.config.text_config.rope_parameters["rope_theta"] == 5000.0
    processor = get_family(FAMILY).load_processor(path, {})
    logits = transformers_logits(full.thinker, processor, *CASES["one_image"])
    np.testing.assert_array_equal(logits, reference(FAMILY, "one_image").logits)


def test_both_config_layouts_build_the_same_model(tiny_checkpoints):
    hub, new = model_args_in_both_layouts(tiny_checkpoints, FAMILY)
    assert hub == new
    assert read_config(tiny_checkpoints, FAMILY, "hub")["model_type"] == "qwen3_omni_moe"
    assert read_config(tiny_checkpoints, FAMILY, "transformers")["model_type"] == (
        "qwen3_omni_moe_thinker")
    text = new.text
    assert text.mrope_interleaved and text.qk_norm and text.rope_theta == 5000.0
    assert (text.num_experts, text.num_experts_per_tok, text.mlp_only_layers) == (4, 2, (0,))
    assert new.position_id_per_seconds == 13 and new.audio.n_window_infer == 200


def test_sanitized_names_are_mlx_community_names(tiny_checkpoints, loaded):
    """Both Hugging Face namings (the thinker's module tree with 3-D experts, the Hub's
    thinker.* with one tensor per expert) map onto one set: mlx-community's names;
    speech-output tensors are dropped."""
    module = get_family(FAMILY)
    model, _ = loaded(FAMILY, "transformers")
    expected = {name for name, _ in parameter_list(model)}
    for layout in LAYOUTS:
        weights = mx.load(str(tiny_checkpoints.path(FAMILY, layout) / "model.safetensors"))
        assert module.is_hf_checkpoint(weights)
        layout_model = module.Model.from_config(read_config(tiny_checkpoints, FAMILY, layout))
        sanitized = layout_model.sanitize(weights)
        assert set(sanitized) == expected, layout
        assert not module.is_hf_checkpoint(sanitized)
    for name in ("thinker.audio_tower.conv2d1.weight", "thinker.audio_tower.proj2.weight",
                 "thinker.audio_tower.layers.0.self_attn.k_proj.bias",
                 "thinker.vision_tower.blocks.0.attn.qkv.weight",
                 "thinker.vision_tower.merger.linear_fc2.weight",
                 "thinker.vision_tower.deepstack_merger_list.0.norm.weight",
                 "thinker.language_model.model.layers.1.mlp.switch_mlp.gate_proj.weight",
                 "thinker.language_model.model.layers.1.mlp.gate.weight",
                 "thinker.language_model.model.layers.0.mlp.gate_proj.weight",
                 "thinker.language_model.lm_head.weight"):
        assert name in expected, name
    # (out, kh, kw, in), and (experts, out, in)
    assert sanitized["thinker.audio_tower.conv2d2.weight"].shape == (8, 3, 3, 8)
    experts = "thinker.language_model.model.layers.1.mlp.switch_mlp"
    assert sanitized[f"{experts}.up_proj.weight"].shape == (4, 16, 64)
