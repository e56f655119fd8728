"""Video and audio loading (mlxvlm.media.load_video / load_audio) on files PyAV writes
offline: frame sampling, the pixel budget, sound tracks, resampling to mono, every kind of
source, every error path; and how chat messages and the CLI carry video and audio."""

from __future__ import annotations

import base64
import http.server
import threading

import numpy as np
import pytest
from PIL import Image

from av_media import coloured_frames, sine, write_audio, write_repeating_video, write_video
from mlxvlm.generate.__main__ import build_parser as build_generate_parser
from mlxvlm.media import (
    Audio,
    MediaError,
    MediaPolicy,
    PreparationCancelled,
    preparing,
    Video,
    fit_pixel_budget,
    load_audio,
    load_video,
    resample_audio,
    sample_frame_indices,
)
from mlxvlm.prompt import normalize_media_messages, normalize_messages

FPS = 10
FRAMES = coloured_frames(30, 96, 64)  # 3 s at 10 fps


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def mp4(media_dir):
    """3 s of video at 10 fps with a 3 s, 330 Hz sound track."""
    return write_video(media_dir / "clip.mp4", FRAMES, fps=FPS, audio=sine(3.0, 16000, 330.0))


@pytest.fixture(scope="module")
def silent_mkv(media_dir):
    """Matroska does not store its frame count: load_video counts the packets."""
    return write_video(media_dir / "silent.mkv", FRAMES[:12], fps=6)


@pytest.fixture(scope="module")
def stereo_wav(media_dir):
    """1 s at 44.1 kHz; left and right the same 1 kHz sine."""
    tone = sine(1.0, 44100, 1000.0, amplitude=0.5)
    return write_audio(media_dir / "stereo.wav", np.stack([tone, tone]), 44100)


def nearest_source_frame(frame: np.ndarray) -> int:
    errors = np.abs(FRAMES.astype(np.int16) - frame.astype(np.int16)).mean(axis=(1, 2, 3))
    return int(errors.argmin())


def dominant_frequency(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[spectrum.argmax()])


def expect_error(loader, source, *fragments: str, **options) -> str:
    with pytest.raises(MediaError) as info:
        loader(source, **options)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


# -------------------------------------------------------------------- frame sampling


def test_frames_are_sampled_at_fps_evenly_over_the_video(mp4):
    video = load_video(mp4, fps=2.0)
    assert video.frames.shape == (6, 64, 96, 3) and video.frames.dtype == np.uint8
    assert video.frame_indices.tolist() == [0, 6, 12, 17, 23, 29]
    assert [nearest_source_frame(f) for f in video.frames] == video.frame_indices.tolist()
    np.testing.assert_allclose(video.timestamps, video.frame_indices / FPS, atol=1e-6)
    assert video.total_frames == 30 and video.source_fps == FPS and video.duration == 3.0
    assert video.sampled_fps == 2.0
    assert video.source_size == (96, 64) and video.note == ""


def test_max_frames_caps_the_sample_and_fps_above_the_source_takes_every_frame(mp4):
    capped = load_video(mp4, fps=2.0, max_frames=4, with_audio=False)
    assert capped.frame_indices.tolist() == [0, 10, 19, 29]
    assert capped.sampled_fps == pytest.approx(4 / 3)
    every = load_video(mp4, fps=50.0, with_audio=False)
    assert every.frame_indices.tolist() == list(range(30))
    assert sample_frame_indices(1, 25.0, 2.0, 768).tolist() == [0]  # a one-frame video
    assert sample_frame_indices(100, 25.0, 0.01, 768).tolist() == [0]  # at least one frame


def test_containers_without_a_frame_count(silent_mkv):
    video = load_video(silent_mkv, fps=3.0)
    assert video.total_frames == 12 and video.frame_indices.tolist() == [0, 2, 4, 7, 9, 11]
    assert [nearest_source_frame(f) for f in video.frames] == [0, 2, 4, 7, 9, 11]
    assert video.audio is None  # no sound track


def test_the_pixel_budget_downscales_while_decoding(mp4):
    budget = 6 * 48 * 32  # six frames at half the width and height
    video = load_video(mp4, fps=2.0, max_pixels=budget, with_audio=False)
    assert video.frames.shape == (6, 32, 48, 3)
    assert video.frames.shape[0] * 32 * 48 <= budget
    assert "downscaled from 96x64 to fit the budget of 9,216 pixels" in video.note
    assert "(downscaled from 96x64" in video.describe()
    w, h = fit_pixel_budget(3840, 2160, 768, 90_316_800)  # a 4K video at the frame cap
    assert (w, h) == (457, 257) and 768 * w * h <= 90_316_800
    assert fit_pixel_budget(640, 360, 10, 90_316_800) == (640, 360)


def test_the_frame_size_limit_is_checked_before_decoding(mp4):
    expect_error(load_video, mp4, "frames are 96x64 = 6,144 pixels", "max_frame_pixels",
                 max_frame_pixels=5000)


def test_describe_says_what_was_sampled(mp4):
    text = load_video(mp4, fps=2.0).describe()
    assert text.startswith(f"video '{mp4}': 3.00 s at 10 fps, 6 of 30 frames sampled (2 per "
                           "second), 96x64; sound track 3.0")


# ------------------------------------------------------------------------ sound tracks


def test_a_videos_sound_track_is_decoded_mono_at_the_requested_rate(mp4):
    video = load_video(mp4, audio_rate=8000)
    sound = video.audio
    assert sound.sampling_rate == 8000 and sound.samples.dtype == np.float32
    assert sound.duration == pytest.approx(3.0, abs=0.05)
    assert dominant_frequency(sound.samples, 8000) == pytest.approx(330.0, abs=2.0)
    assert load_video(mp4, with_audio=False).audio is None


def test_an_overlong_sound_track_is_cut_not_refused(mp4):
    sound = load_video(mp4, max_audio_seconds=1.0).audio
    assert sound.samples.shape[0] == 16000
    assert "cut at the limit of 1 s" in sound.note


# ----------------------------------------------------------------------------- audio


def test_stereo_audio_is_mixed_to_mono_and_resampled(stereo_wav):
    sound = load_audio(stereo_wav, sampling_rate=16000)
    assert sound.sampling_rate == 16000 and sound.samples.shape == (16000,)
    assert sound.samples.dtype == np.float32
    assert dominant_frequency(sound.samples, 16000) == pytest.approx(1000.0, abs=2.0)
    # the mean of two equal channels keeps the amplitude (16-bit PCM rounding aside)
    assert np.abs(sound.samples[100:-100]).max() == pytest.approx(0.5, abs=0.01)
    assert sound.source_rate == 44100 and sound.source_channels == 2
    assert sound.describe() == (f"audio '{stereo_wav}': 1.00 s, mono 16000 Hz "
                                "(from 44100 Hz, 2 channels)")


def test_channels_are_averaged(media_dir):
    tone = sine(0.5, 16000, 500.0)
    path = write_audio(media_dir / "opposite.wav", np.stack([tone, -tone]), 16000)
    assert np.abs(load_audio(path).samples).max() < 1e-4


def test_native_rate_when_none_is_asked(stereo_wav):
    sound = load_audio(stereo_wav)
    assert sound.sampling_rate == 44100 and sound.samples.shape == (44100,)


@pytest.mark.parametrize("suffix,codec", [(".flac", "flac"), (".mp3", "libmp3lame"),
                                          (".ogg", "libopus")])
def test_compressed_audio_containers(media_dir, suffix, codec):
    rate = 48000 if codec == "libopus" else 22050
    path = write_audio(media_dir / f"tone{suffix}", sine(0.5, rate, 600.0), rate, codec=codec)
    sound = load_audio(path, sampling_rate=16000)
    assert sound.duration == pytest.approx(0.5, abs=0.06)
    assert dominant_frequency(sound.samples, 16000) == pytest.approx(600.0, abs=4.0)


def test_the_sound_of_a_video_file_as_audio(mp4):
    sound = load_audio(mp4, sampling_rate=16000)
    assert dominant_frequency(sound.samples, 16000) == pytest.approx(330.0, abs=2.0)


def test_resampling_arrays_keeps_frequency_and_length():
    tone = sine(2.0, 44100, 2000.0)
    out = resample_audio(tone, 44100, 16000)
    assert abs(out.shape[0] - 32000) <= 32 and out.dtype == np.float32
    assert dominant_frequency(out, 16000) == pytest.approx(2000.0, abs=2.0)
    assert np.abs(out[200:-200]).max() == pytest.approx(0.5, abs=0.02)
    assert resample_audio(tone, 44100, 44100) is not None


def test_arrays_pairs_and_audio_objects():
    tone = sine(1.0, 8000, 300.0)
    sound = load_audio(tone, sampling_rate=8000)
    assert isinstance(sound, Audio) and sound.sampling_rate == 8000
    np.testing.assert_array_equal(sound.samples, tone)
    pair = load_audio((tone, 8000), sampling_rate=16000)
    assert pair.sampling_rate == 16000 and abs(pair.samples.shape[0] - 16000) <= 16
    assert load_audio(sound) is sound
    assert load_audio(sound, sampling_rate=16000).samples.shape == pair.samples.shape


# ----------------------------------------------------------------------- video sources


def test_bytes_and_data_url_sources(mp4):
    data = mp4.read_bytes()
    for source in (data, bytearray(data), f"data:video/mp4;base64,{base64.b64encode(data).decode()}"):
        video = load_video(source, fps=2.0, with_audio=False)
        assert video.frame_indices.tolist() == [0, 6, 12, 17, 23, 29]


def test_http_source(mp4):
    body = mp4.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/clip.mp4"
        assert load_video(url, fps=1.0, with_audio=False).frames.shape[0] == 3
        expect_error(load_video, url, "fetching remote URLs is disabled", allow_remote=False)
    finally:
        server.shutdown()


def test_frames_given_directly():
    frames = coloured_frames(4, 40, 30)
    video = load_video(frames, fps=4.0)
    np.testing.assert_array_equal(video.frames, frames)
    assert video.sampled_fps == 4.0 and video.frame_indices.tolist() == [0, 1, 2, 3]
    assert video.timestamps.tolist() == [0.0, 0.25, 0.5, 0.75]
    pil = load_video([Image.fromarray(f) for f in frames])
    np.testing.assert_array_equal(pil.frames, frames)
    assert pil.sampled_fps == 2.0  # the default fps: what the frames stand for
    small = load_video(frames, max_pixels=4 * 20 * 15)
    assert small.frames.shape == (4, 15, 20, 3) and "downscaled" in small.note
    assert load_video(video) is video


# ------------------------------------------------------------------------------ errors


def test_missing_empty_and_directory(tmp_path):
    expect_error(load_video, tmp_path / "nope.mp4", "cannot load video", "no such file")
    (tmp_path / "empty.mp4").write_bytes(b"")
    expect_error(load_video, tmp_path / "empty.mp4", "the file is empty")
    expect_error(load_audio, tmp_path, "it is a directory")
    expect_error(load_audio, b"", "the data is empty")


def test_unrecognised_truncated_and_wrong_kind_of_file(mp4, stereo_wav, silent_mkv, tmp_path):
    expect_error(load_video, b"\x00garbage" * 100, "not a recognised video format",
                 "MP4, WebM")
    truncated = tmp_path / "truncated.mp4"
    truncated.write_bytes(mp4.read_bytes()[: mp4.stat().st_size // 2])
    expect_error(load_video, truncated, f"'{truncated}'", "truncated or corrupt")
    expect_error(load_audio, b"\x00garbage" * 100, "not a recognised audio format", "WAV")
    expect_error(load_video, stereo_wav, "has no video stream", "pass it as audio")
    expect_error(load_audio, silent_mkv, "has no audio stream")
    png = tmp_path / "picture.png"
    Image.fromarray(FRAMES[0]).save(png)
    expect_error(load_video, png, "it is an image (png_pipe), not a video file",
                 "pass it as an image")
    expect_error(load_audio, png, "it is an image (png_pipe), not an audio file")


def test_limits(mp4, stereo_wav):
    expect_error(load_video, mp4, "larger than the limit", max_bytes=1000)
    expect_error(load_audio, stereo_wav, "longer than the limit of 0.5 s", max_seconds=0.5)
    expect_error(load_audio, np.zeros(100, np.float32), "longer than the limit",
                 sampling_rate=100, max_seconds=0.5)


# ------------------------------------------------------------ what decoding may cost


def test_frames_obey_the_policys_image_pixel_limit(mp4):
    """96 x 64 = 6,144 pixels a frame: refused from the header under a 6,000-pixel image
    limit, which names the policy's option; decoded at 6,144."""
    expect_error(load_video, mp4, "frames are 96x64 = 6,144 pixels", "max_image_pixels",
                 max_image_pixels=6000)
    assert load_video(mp4, max_image_pixels=6144).frames.shape[1:] == (64, 96, 3)


def test_decoded_pixels_are_charged_to_the_request(mp4):
    """Each load of the 30-frame clip decodes 30 x 6,144 pixels; within one request, the
    second load passes a budget of one and a half clips and is refused before decoding."""
    clip = 30 * 96 * 64
    policy = MediaPolicy(max_video_decode_pixels=clip * 3 // 2)
    assert load_video(mp4, policy=policy).total_frames == 30
    assert load_video(mp4, policy=policy).total_frames == 30  # a request of its own each
    with preparing() as work:
        load_video(mp4, policy=policy, with_audio=False)
        assert work.decoded_pixels == clip
        message = expect_error(load_video, mp4, f"its 30 frames of 96x64 are {clip:,} decoded "
                               f"pixels (with the {clip:,} of the request's other media)",
                               "max_video_decode_pixels", policy=policy)
    assert "raise max_video_decode_pixels" in message


def test_frames_are_counted_while_decoding(mp4):
    """A container that states fewer frames than it holds: its frames are counted as the
    decoder produces them."""
    from mlxvlm.media.decode_work import Decoding

    with Decoding(MediaPolicy(max_video_frames=3), "video", "'clip.mp4'") as work:
        work.claim(2, 96, 64)
        for _ in range(3):
            work.frame(96, 64)
        with pytest.raises(MediaError, match="more than 3 frames.*more than its container says"):
            work.frame(96, 64)


def test_frame_count_and_cpu_time_bounds(mp4, silent_mkv, media_dir):
    expect_error(load_video, mp4, "it has 30 frames, more than the limit of 20 per video",
                 max_video_frames=20)
    # Matroska does not say: its packets are counted, only as far as the limit.
    expect_error(load_video, silent_mkv, "it has more than 10 frames, the limit per video",
                 max_video_frames=10)
    slow = write_repeating_video(media_dir / "slow.mp4", 2048, 2048, 400)
    message = expect_error(load_video, slow, "more than the limit of 0.01 CPU seconds",
                           "max_decode_seconds", max_decode_seconds=0.01)
    assert "stopped after" in message


def test_a_cancelled_request_stops_decoding(mp4):
    import threading

    cancel = threading.Event()
    cancel.set()
    with preparing(cancel), pytest.raises(PreparationCancelled,
                                          match="stopped decoding video .* after 0 frames"):
        load_video(mp4)


def test_bad_options_and_sources(mp4):
    expect_error(load_video, mp4, "fps must be positive", fps=0)
    expect_error(load_video, mp4, "max_frames must be positive", max_frames=0)
    expect_error(load_video, 42, "unsupported source type int")
    expect_error(load_audio, 42, "unsupported source type int")
    expect_error(load_audio, np.zeros(10, np.float32), "needs its sampling rate")
    expect_error(load_audio, np.zeros((2, 10), np.float32), "shape (2, 10)", sampling_rate=8000)
    expect_error(load_audio, np.zeros(10, np.int16), "dtype int16", sampling_rate=8000)
    expect_error(load_audio, np.array([0.0, np.nan], np.float32), "NaN", sampling_rate=8000)
    expect_error(load_video, np.zeros((2, 8, 8), np.uint8), "shape (2, 8, 8)")
    expect_error(load_video, [], "the list of frames is empty")
    expect_error(load_video, [FRAMES[0], FRAMES[0, :32]], "frames differ in size")
    expect_error(load_video, [FRAMES[0], "/no/such/frame.png"], "frame 1:", "no such file")


def test_data_url_of_the_wrong_media_type(mp4):
    payload = base64.b64encode(mp4.read_bytes()).decode()
    expect_error(load_video, f"data:image/png;base64,{payload}",
                 "media type is 'image/png', not video/*")


def test_local_file_policy(mp4, tmp_path):
    expect_error(load_video, mp4, "outside the allowed directory", allowed_dir=tmp_path)
    expect_error(load_audio, mp4, "reading local files is disabled", allow_local=False)
    # frames named by path obey the same policy
    frame = tmp_path / "frame.png"
    Image.fromarray(FRAMES[0]).save(frame)
    expect_error(load_video, [str(frame)], "frame 0:", "reading local files is disabled",
                 allow_local=False)
    assert load_video([str(frame)], allowed_dir=tmp_path).frames.shape == (1, 64, 96, 3)


# ------------------------------------------------------------------ messages and CLI


def test_messages_carry_video_and_audio_parts_in_prompt_order():
    messages = [
        {"role": "user", "content": [
            {"type": "audio", "audio": "a.wav"},
            {"type": "image"},
            {"type": "text", "text": "and"},
            {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            {"type": "video"},
        ]},
    ]
    normalized, media = normalize_media_messages(messages, {"image": ["i.png"], "video": ["v2"]})
    assert media == [("audio", "a.wav"), ("image", "i.png"), ("video", "https://x/v.mp4"),
                     ("audio", "data:audio/wav;base64,UklGRg=="), ("video", "v2")]
    assert [p["type"] for p in normalized[0]["content"]] == [
        "audio", "image", "text", "video", "audio", "video"]
    # the image-only view keeps its old contract
    mixed = [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}, {"type": "image"}]}]
    assert normalize_messages(mixed, ["i.png"])[1] == ["i.png"]


def test_message_errors_name_the_kind():
    from mlxvlm.errors import MlxvlmError

    with pytest.raises(MlxvlmError, match="an audio part with no audio; .* pass audio="):
        normalize_media_messages([{"role": "user", "content": [{"type": "audio"}]}])
    with pytest.raises(MlxvlmError, match=r"1 video\(s\) were passed"):
        normalize_media_messages([{"role": "user", "content": "hi"}], {"video": ["v.mp4"]})


def test_cli_keeps_media_in_command_line_order():
    args = build_generate_parser().parse_args(
        ["--model", "m", "--audio", "a.wav", "--image", "i.png", "j.png", "--video", "v.mp4",
         "--fps", "1.5", "--max-frames", "8"]
    )
    assert args.media == [("audio", "a.wav"), ("image", "i.png"), ("image", "j.png"),
                          ("video", "v.mp4")]
    assert args.image == ["i.png", "j.png"] and args.fps == 1.5 and args.max_frames == 8
    assert build_generate_parser().parse_args(["--model", "m"]).media is None
    assert isinstance(load_video(coloured_frames(1, 8, 8)), Video)


def test_cli_fails_fast_on_a_bad_audio_file(tmp_path, capsys):
    """The CLI decodes media before loading the model: a bad file is one error line and
    exit code 2, even with a model that does not exist."""
    from mlxvlm.generate.__main__ import main as run_generate_cli

    bad = tmp_path / "noise.wav"
    bad.write_bytes(b"\x00garbage" * 50)
    code = run_generate_cli(["--model", str(tmp_path / "no-model"), "--audio", str(bad)])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: cannot load audio '{bad}': not a recognised audio format, or the file is "
        "truncated or corrupt; use a common audio format (WAV, MP3, FLAC, OGG, M4A) or a "
        "video with sound"]
