"""What the omni families' parity tests (Qwen2.5-Omni, Qwen3-Omni) share: prompts with
audio and video, transformers' side of them (its processor called as it documents, with
the audio track of a video), our side, and the prompt layouts whose positions are checked
against transformers' ``get_rope_index``."""

from __future__ import annotations

import numpy as np

from av_media import sine
from parity import NEW_TOKENS, Reference
from mlxvlm import stream_generate
from mlxvlm.media import load_video
from mlxvlm.prompt import prepare_inputs


def media_turn(*parts: str, text: str) -> list[dict]:
    """One user turn: a part of each type in ``parts`` ("image", "audio", "video"), then
    ``text``."""
    return [{"role": "user", "content": [*({"type": p} for p in parts),
                                         {"type": "text", "text": text}]}]


def video_metadata(video):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=video.total_frames, fps=video.source_fps,
                         frames_indices=video.frame_indices.tolist())


def reference_batch(processor, messages, media: dict):
    """transformers' processor inputs for a prompt with ``media`` ("image", "audio",
    "video" lists; one video at most, its sound track heard when it has one), and the
    flag its model then needs."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    kwargs = {"images": media.get("image"), "audio": media.get("audio")}
    extra = {}
    if media.get("video"):
        video = media["video"][0]
        kwargs.update(videos=[video.frames], video_metadata=[video_metadata(video)])
        if video.audio is not None:
            kwargs.update(audio=[video.audio.samples], load_audio_from_video=True,
                          audio_from_video_indices=[0])
            extra = {"use_audio_in_video": True}
    return processor(text=[text], return_tensors="pt", **kwargs), extra


def media_reference_run(model, processor, messages, media: dict) -> Reference:
    """transformers' prompt ids, first-pass logits, greedy tokens and thinnest margin."""
    import torch

    batch, extra = reference_batch(processor, messages, media)
    with torch.no_grad():
        logits = model(**batch, **extra).logits[0].numpy()
        out = model.generate(**batch, **extra, max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, batch["input_ids"].shape[1]:].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return Reference(batch["input_ids"][0].tolist(), logits, tokens, min(margins))


def media_logits(model, processor, messages, media: dict):
    """Our prepared inputs and first-pass logits."""
    inputs = prepare_inputs(processor, messages, media.get("image"), video=media.get("video"),
                            audio=media.get("audio"), feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    return inputs, np.array(logits[0])


def media_tokens(model, processor, messages, media: dict, **options) -> list[int]:
    """Our greedy tokens through ``stream_generate``."""
    results = stream_generate(model, processor, messages, image=media.get("image"),
                              video=media.get("video"), audio=media.get("audio"),
                              max_tokens=NEW_TOKENS, **options)
    return [r.token for r in results]


def processor_layouts(processor, clip, image, sounds):
    """Prompts as the processor lays them out, (name, batch, with_sound): an image, a
    sound and a video; a sound and a video whose track outlasts it; a slow video (frames
    1 s apart) with a short track. ``sounds``: three clips of different lengths."""
    sound_a, sound_b, sound_c = sounds
    slow = load_video(clip.frames[:8], fps=1.0)
    layouts = {
        "image_audio_video": (media_turn("image", "audio", "video", text="All of it."),
                              {"images": [image], "audio": [sound_a], "videos": [clip]}, False),
        "video_with_long_sound": (media_turn("audio", "video", text="Both."),
                                  {"audio": [sound_b], "videos": [clip],
                                   "track": sine(5.0, 16000, 250.0)}, True),
        "slow_video_with_short_sound": (media_turn("video", text="Go."),
                                        {"videos": [slow], "track": sound_c}, True),
    }
    for name, (messages, media, with_sound) in layouts.items():
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        videos = media["videos"]
        kwargs = {"images": media.get("images"), "audio": list(media.get("audio", [])) or None,
                  "videos": [v.frames for v in videos],
                  "video_metadata": [video_metadata(v) for v in videos]}
        if with_sound:
            kwargs["audio"] = [*(media.get("audio") or []), media["track"]]
            kwargs["load_audio_from_video"] = True
            kwargs["audio_from_video_indices"] = [None] * len(media.get("audio") or []) + [0]
        yield name, processor(text=[text], return_tensors="pt", **kwargs), with_sound


def assert_positions_match_get_rope_index(model, reference_model, layouts) -> None:
    """Our TMRoPE positions and rope delta are transformers' for every layout."""
    for name, batch, with_sound in layouts:
        mel_frames = batch["feature_attention_mask"].sum(-1)
        ref_positions, ref_delta = reference_model.get_rope_index(
            batch["input_ids"], batch.get("image_grid_thw"), batch.get("video_grid_thw"),
            batch["attention_mask"], with_sound, mel_frames, batch.get("video_second_per_grid"))
        state = model.rope_state(
            batch["input_ids"][0].numpy(), batch.get("image_grid_thw"),
            batch.get("video_grid_thw"), batch.get("video_second_per_grid"), mel_frames.numpy())
        np.testing.assert_array_equal(np.array(state.position_ids), ref_positions[:, 0].numpy(),
                                      err_msg=name)
        assert state.rope_delta == float(ref_delta), name
