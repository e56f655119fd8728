"""Gradio chat history -> the conversation the model sees (no model, no server)."""

from __future__ import annotations

import pytest
from PIL import Image

from mlxvlm.errors import MlxvlmError
from mlxvlm.media import MediaError
from mlxvlm.ui.conversation import NOTICE_TITLE, build_conversation
from mlxvlm.ui.media_kinds import MEDIA_KINDS, supported_kinds
from tiny import make_image


@pytest.fixture
def images(tmp_path):
    paths = []
    for seed in range(2):
        path = tmp_path / f"image{seed}.png"
        make_image(32, 32, seed=seed).save(path)
        paths.append(str(path))
    return paths


def file(path: str) -> dict:
    """A file part as Gradio's chatbot hands it back."""
    return {"type": "file", "file": {"path": path, "mime_type": "image/png"}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def notice(content: str) -> dict:
    return {"role": "assistant", "content": [text(content)], "metadata": {"title": NOTICE_TITLE}}


def shape(messages: list[dict]) -> list:
    """Messages with images replaced by their sizes, for comparison."""
    out = []
    for m in messages:
        if isinstance(m["content"], str):
            out.append((m["role"], m["content"]))
        else:
            out.append((m["role"], [p.get("text") or p["image"].size for p in m["content"]]))
    return out


def test_turns_split_over_messages_are_merged_and_images_kept(images):
    history = [
        {"role": "user", "content": [file(images[0])]},
        {"role": "user", "content": [text("What is it?")]},
        {"role": "assistant", "content": [text("A pattern.")]},
    ]
    conversation = build_conversation(
        history, {"text": "And this?", "files": [images[1]]}, MEDIA_KINDS
    )
    assert shape(conversation.messages) == [
        ("user", [(32, 32), "What is it?"]),
        ("assistant", "A pattern."),
        ("user", [(32, 32), "And this?"]),
    ]
    assert isinstance(conversation.messages[0]["content"][0]["image"], Image.Image)
    assert len(conversation.image_hashes) == 2
    assert conversation.image_hashes[0] != conversation.image_hashes[1]
    again = build_conversation([], {"text": "x", "files": [images[0]]}, MEDIA_KINDS)
    assert again.image_hashes[0] == conversation.image_hashes[0]


def test_a_notice_leaves_out_the_turn_it_answered(images, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    history = [
        {"role": "user", "content": [text("Hi")]},
        {"role": "assistant", "content": [text("Hello.")]},
        {"role": "user", "content": [file(str(broken)), text("What is it?")]},
        notice("cannot load image"),
        {"role": "user", "content": [text("Tell me more.")]},
        {"role": "assistant", "content": [text("A partial ans")]},
        notice("internal error"),
    ]
    conversation = build_conversation(history, {"text": "Again?", "files": []}, MEDIA_KINDS)
    assert shape(conversation.messages) == [
        ("user", ["Hi"]),
        ("assistant", "Hello."),
        ("user", ["Again?"]),
    ]


def test_a_stopped_unanswered_turn_joins_the_next_one():
    history = [{"role": "user", "content": [text("First.")]}]
    conversation = build_conversation(history, "Second.", MEDIA_KINDS)
    assert shape(conversation.messages) == [("user", ["First.", "Second."])]


def test_placeholder_strings_are_removed_from_text():
    history = [
        {"role": "user", "content": "Show <|image_pad|> me"},
        {"role": "assistant", "content": "an<|image_pad|>swer"},
    ]
    conversation = build_conversation(
        history, "<|image_pad|>", MEDIA_KINDS, placeholders=["<|image_pad|>"]
    )
    assert shape(conversation.messages) == [
        ("user", ["Show  me"]),
        ("assistant", "answer"),
        ("user", []),
    ]


def test_unreadable_and_unsupported_attachments_are_media_errors(tmp_path, images):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(MediaError, match="notes.txt.*takes image"):
        build_conversation([], {"text": "Read this", "files": [str(notes)]}, MEDIA_KINDS)
    with pytest.raises(MediaError, match="text only"):
        build_conversation([], {"text": "Look", "files": [images[0]]}, ())
    outside = {"allow_remote": False, "allowed_dir": str(tmp_path / "uploads")}
    with pytest.raises(MediaError):
        build_conversation([], {"text": "Look", "files": [images[0]]}, MEDIA_KINDS, outside)
    with pytest.raises(MlxvlmError, match="empty"):
        build_conversation([], {"text": "", "files": []}, MEDIA_KINDS)


def test_videos_and_audio_go_in_as_paths_and_turn_prefix_reuse_off(images, tmp_path):
    clip, sound = str(tmp_path / "clip.mp4"), str(tmp_path / "sound.wav")
    conversation = build_conversation(
        [
            {"role": "user", "content": [file(images[0]), text("And?")]},
            {"role": "assistant", "content": "Yes."},
        ],
        {"text": "Both", "files": [clip, {"path": sound, "mime_type": "audio/wav"}]},
        MEDIA_KINDS,
    )
    assert conversation.messages[-1]["content"] == [
        {"type": "video", "video": clip},
        {"type": "audio", "audio": sound},
        {"type": "text", "text": "Both"},
    ]
    assert conversation.image_hashes is None  # the prefix keys describe images only


def test_a_pdf_upload_is_its_pages_as_images_of_the_turn(tmp_path):
    """Each page an image part (rendered as mlxvlm.media renders it), each hashed for
    prefix reuse; a PDF longer than the chat's page limit is refused."""
    from pdf_documents import pdf_of

    from mlxvlm.batching.prefix_cache import image_hash
    from mlxvlm.media import MediaLimitError, load_pdf
    from mlxvlm.ui.media_kinds import UI_MAX_PDF_PAGES

    document = tmp_path / "upload.bin"  # Gradio's MIME type, not the name, says PDF
    document.write_bytes(pdf_of("red-circle.png", "blue-triangle.png"))
    upload = {"path": str(document), "mime_type": "application/pdf"}
    conversation = build_conversation([], {"text": "Read it", "files": [upload]}, MEDIA_KINDS)
    pages = load_pdf(document)
    content = conversation.messages[-1]["content"]
    assert [part["type"] for part in content] == ["image", "image", "text"]
    assert conversation.image_hashes == [image_hash(page) for page in pages]
    assert [image_hash(part["image"]) for part in content[:2]] == conversation.image_hashes
    long = tmp_path / "long.pdf"
    long.write_bytes(pdf_of(*["red-circle.png"] * (UI_MAX_PDF_PAGES + 1)))
    with pytest.raises(MediaLimitError, match=f"more than the limit of {UI_MAX_PDF_PAGES}; "
                       "send fewer pages, or split it"):
        build_conversation([], {"text": "Read it", "files": [str(long)]}, MEDIA_KINDS)


def test_kinds_follow_the_model_and_its_processor():
    class Model:
        feature_names = ("pixel_values", "image_grid_thw", "pixel_values_videos")

    class ImageProcessor:
        image_processor = object()
        video_processor = None

    class VideoProcessor(ImageProcessor):
        video_processor = object()

    class TextModel:
        feature_names = ()

    assert [k.name for k in supported_kinds(Model(), ImageProcessor())] == ["image", "pdf"]
    assert [k.name for k in supported_kinds(Model(), VideoProcessor())] == ["image", "pdf",
                                                                            "video"]
    assert supported_kinds(TextModel(), VideoProcessor()) == ()


def test_a_failed_turn_marks_the_earlier_figures_or_says_there_are_none():
    from mlxvlm.ui.stats import FAILED_TURN, NO_ANSWER_YET, AnswerStats, stale_markdown

    earlier = AnswerStats(10, 0, 0.5, 5, 0.2, 0.1, "stop")
    assert stale_markdown(earlier) == f"{FAILED_TURN}\n\n{earlier.markdown()}"
    assert stale_markdown(None).endswith(NO_ANSWER_YET) and "no answer" in stale_markdown(None)


def test_the_sampling_controls_start_at_the_checkpoints_generation_config(tiny_checkpoints):
    from mlxvlm import load
    from mlxvlm.sampling.defaults import checkpoint_defaults_from
    from mlxvlm.text.tokenization import processor_state
    from mlxvlm.ui.app import build_app, upload_media_options
    from mlxvlm.ui.session import ChatSession

    model, processor = load(tiny_checkpoints.path("qwen2_vl", "hub"))

    def initial_values(defaults: dict) -> dict:
        processor_state(processor).sampling_defaults = checkpoint_defaults_from(defaults)
        session = ChatSession(model, processor, "tiny", media_options=upload_media_options())
        config = build_app(session).get_config_file()
        return {c["props"]["label"]: c["props"]["value"] for c in config["components"]
                if c.get("type") == "slider"}

    sampled = initial_values({"do_sample": True, "temperature": 0.7, "top_p": 0.8,
                              "repetition_penalty": 1.1})
    assert sampled["Temperature (0: greedy)"] == 0.7
    assert sampled["Top-p"] == 0.8
    assert sampled["Repetition penalty (1: off)"] == 1.1
    greedy = initial_values({"do_sample": False, "temperature": 0.7})
    assert greedy["Temperature (0: greedy)"] == 0.0 and greedy["Top-p"] == 1.0


def test_during_a_turn_the_figures_panel_says_they_are_the_previous_answers(tiny_checkpoints):
    """While a turn is prepared and streamed the panel shows the model's previous
    figures marked as such (they may be another conversation's); the turn's last update
    shows its own figures, unmarked."""
    from mlxvlm import load
    from mlxvlm.ui.session import ChatSession
    from mlxvlm.ui.stats import NO_ANSWER_YET, TURN_UNDER_WAY, earlier_markdown

    assert earlier_markdown(None) == NO_ANSWER_YET
    session = ChatSession(*load(tiny_checkpoints.path("qwen2_vl", "hub")), "tiny").start()
    try:
        first = list(session.respond("Describe a garden.", [], max_tokens=12))
        assert all(TURN_UNDER_WAY not in panel for _, panel in first)
        assert first[-1][1] == session.last_stats.markdown()
        earlier = session.last_stats
        second = list(session.respond("Describe a house.", [], max_tokens=12))
        assert len(second) > 1
        for _, panel in second[:-1]:
            assert panel == f"{TURN_UNDER_WAY}\n\n{earlier.markdown()}"
        assert session.last_stats is not earlier
        assert second[-1][1] == session.last_stats.markdown()
    finally:
        session.close()
