"""Hostile media and oversized prompts against `python -m mlxvlm.server` as users start
it (issue 39, items 3-5; issue 38, item 8): what decoding a video may cost, checked from
its container before decoding and while decoding; a departed client's video work
stopped while another client's text request is answered; video frames under
--max-image-pixels; a multi-megabyte message refused before it is tokenized; and media
errors that name the server's own flags. /metrics counts each refusal by its limit."""

from __future__ import annotations

import base64
import json
import re
import socket

import httpx
import pytest
from server_harness import MODEL_ID, bomb_png, wait_until
from server_process import ServerProcess

from av_media import coloured_frames, write_repeating_video, write_video

# The cost of the file: one keyframe, then 6,000 frames that repeat it, at
# 4096 x 4096 -- about 250 KB, and every frame decoded in full.
HOSTILE = (4096, 4096, 6000)
CPU_LIMIT = 0.3  # seconds: a few dozen of those frames, however fast the machine


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return str(tiny_checkpoints.path("qwen2_vl", "hub"))


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile-videos")
    width, height, frames = HOSTILE
    return {
        "hostile": write_repeating_video(folder / "hostile.mp4", width, height, frames),
        # Within the default pixel budget (8.4 G of 10 G), but seconds of CPU to decode.
        "slow": write_repeating_video(folder / "slow.mp4", 4096, 4096, 500),
        # Tiny frames, one more than the default --max-video-frames (18,000).
        "long": write_repeating_video(folder / "long.mp4", 32, 32, 18_001),
        # Four frames of 8192 x 4096 = 33.5 M pixels, above --max-image-pixels' 25 M.
        "huge_frames": write_repeating_video(folder / "huge.mp4", 8192, 4096, 4),
        "ordinary": write_video(folder / "ordinary.mp4", coloured_frames(20, 96, 64), fps=10),
    }


@pytest.fixture(scope="module")
def bounded(model):
    """The server's defaults, but a small CPU bound on decoding."""
    with ServerProcess("--model", model, "--served-model-name", MODEL_ID,
                       "--max-media-decode-seconds", str(CPU_LIMIT)) as server:
        yield server


@pytest.fixture(scope="module")
def unbounded(model):
    """Decoding bounded by nothing a video of the issue's size passes, so that its work
    is stopped only by its client leaving; remote media on."""
    with ServerProcess("--model", model, "--served-model-name", MODEL_ID,
                       "--max-video-decode-pixels", str(10**15),
                       "--max-media-decode-seconds", str(10**6),
                       "--allow-remote-media", "--log-level", "info") as server:
        yield server


def data_url(path, media_type="video/mp4") -> str:
    return f"data:{media_type};base64," + base64.b64encode(path.read_bytes()).decode()


def chat(*parts, text="Describe it.") -> dict:
    content = [*parts, {"type": "text", "text": text}]
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0}


def video_part(path) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(path)}}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def post(server, body: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=timeout)


def refused(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


def metric(server, name: str, **labels) -> float:
    """A sample of /metrics (0 when it has none yet)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    wanted = f"{name}{{{label_text}}}" if labels else name
    for line in text.splitlines():
        if line.split(" ")[0] == wanted:
            return float(line.split(" ")[1])
    return 0.0


# -- what decoding a video may cost ------------------------------------------------------


def test_a_video_that_would_decode_too_many_pixels_is_refused_from_its_container(
        bounded, videos):
    width, height, frames = HOSTILE
    before = metric(bounded, "mlxvlm_requests_refused_total", reason="max_video_decode_pixels")
    message = refused(post(bounded, chat(video_part(videos["hostile"]))))
    # The container's claim, refused before any frame is decoded (the count made while
    # decoding would say how many frames it had decoded).
    assert f"its {frames:,} frames of {width}x{height} are {frames * width * height:,} " \
        "decoded pixels" in message
    assert "10,000,000,000" in message and "--max-video-decode-pixels" in message
    assert metric(bounded, "mlxvlm_requests_refused_total",
                  reason="max_video_decode_pixels") == before + 1


def test_a_video_with_more_frames_than_allowed_is_refused(bounded, videos):
    message = refused(post(bounded, chat(video_part(videos["long"]))))
    assert "18,001 frames, more than the limit of 18,000" in message
    assert "--max-video-frames" in message
    assert metric(bounded, "mlxvlm_requests_refused_total", reason="max_video_frames") >= 1


def test_decoding_stops_at_its_cpu_time(bounded, videos):
    message = refused(post(bounded, chat(video_part(videos["slow"]))))
    assert f"more than the limit of {CPU_LIMIT:g} CPU seconds" in message
    assert "--max-media-decode-seconds" in message
    frames = int(re.search(r"stopped after ([\d,]+) frames", message).group(1).replace(",", ""))
    assert 0 < frames < 500
    assert metric(bounded, "mlxvlm_requests_refused_total", reason="max_decode_seconds") >= 1


def test_video_frames_obey_max_image_pixels(bounded, videos):
    message = refused(post(bounded, chat(video_part(videos["huge_frames"]))))
    assert "8192x4096 = 33,554,432 pixels, more than the limit of 25,000,000" in message
    assert "--max-image-pixels" in message
    assert metric(bounded, "mlxvlm_requests_refused_total", reason="max_image_pixels") >= 1


def test_an_ordinary_video_is_answered(bounded, videos):
    response = post(bounded, chat(video_part(videos["ordinary"])))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 20  # the frames' tokens are in


# -- a departed client's work stops, and never holds up text-only requests -----------------


def send_and_keep_open(server, body: dict) -> socket.socket:
    """Send a request on a raw connection and leave it waiting for the answer (a client
    that gives up later: closing the socket)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_departed_clients_video_work_stops_and_text_is_answered_meanwhile(unbounded, videos):
    """Two clients send the issue's video and wait; while both preparation workers
    decode it, a third client's text request is answered; once the two leave, their
    decoding stops (each would take tens of CPU seconds to finish)."""
    cancelled_before = metric(unbounded, "mlxvlm_preparations_cancelled_total")
    body = chat(video_part(videos["hostile"]))
    leaving = [send_and_keep_open(unbounded, body) for _ in range(2)]
    try:
        assert wait_until(lambda: metric(unbounded, "mlxvlm_requests_preparing",
                                         inputs="media") == 2, timeout=60), unbounded.log()
        answer = post(unbounded, {"model": MODEL_ID, "max_tokens": 4, "temperature": 0,
                                  "messages": [{"role": "user", "content": "Hello there"}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] is not None
        # Answered while both media workers were still busy with the videos.
        assert metric(unbounded, "mlxvlm_requests_preparing", inputs="media") == 2
        assert metric(unbounded, "mlxvlm_preparations_cancelled_total") == cancelled_before
    finally:
        for sock in leaving:
            sock.close()
    assert wait_until(lambda: metric(unbounded, "mlxvlm_preparations_cancelled_total")
                      == cancelled_before + 2, timeout=60), unbounded.log()
    assert metric(unbounded, "mlxvlm_requests_preparing", inputs="media") == 0
    assert metric(unbounded, "mlxvlm_requests_in_flight") == 0
    stopped = re.findall(r"stopped decoding video .* after ([\d,]+) frames: the client went "
                         "away", unbounded.log())
    assert len(stopped) == 2, unbounded.log()
    assert all(int(n.replace(",", "")) < HOSTILE[2] for n in stopped)


# -- a multi-megabyte message ----------------------------------------------------------------


def test_a_multi_megabyte_message_is_refused_before_tokenizing(bounded):
    text = "garden path " * 500_000  # 6 MB
    before = metric(bounded, "mlxvlm_requests_refused_total", reason="context_length")
    rss = bounded.rss_bytes()
    message = refused(post(bounded, {"model": MODEL_ID, "max_tokens": 4,
                                     "messages": [{"role": "user", "content": text}]}))
    assert "characters long" in message and "1024 tokens" in message
    # Tokenizing it whole held over a gigabyte; the body, its JSON and the rendered chat
    # are tens of megabytes.
    assert bounded.rss_bytes() - rss < 300 * 2**20
    assert metric(bounded, "mlxvlm_requests_refused_total",
                  reason="context_length") == before + 1


def test_a_long_message_within_the_character_bound_is_counted_in_pieces(bounded):
    """Short enough for the character bound of a 16-character vocabulary (65,536
    characters), too long for 1,024 tokens: refused by a count that stops early, with
    the same message as the check after tokenizing."""
    message = refused(post(bounded, {"model": MODEL_ID, "max_tokens": 4,
                                     "messages": [{"role": "user", "content": "cat " * 10_000}]}))
    assert re.search(r"the prompt is at least \d+ tokens long but the model's context is "
                     r"1024 tokens", message), message


# -- errors name the server's flags -----------------------------------------------------------


def test_media_errors_name_the_servers_flags(bounded, unbounded, tmp_path):
    picture = tmp_path / "picture.png"
    picture.write_bytes(bomb_png(8, 8))
    remote = refused(post(bounded, chat(image_part("http://example.com/cat.png"))))
    assert "fetching remote URLs is disabled" in remote
    assert "--allow-remote-media" in remote and "allow_remote" not in remote
    local = refused(post(bounded, chat(image_part(str(picture)))))
    assert "reading local files is disabled" in local and "--allowed-media-dir" in local
    assert "data URL" in local and "http" not in local.split(";", 1)[1]
    # With remote media on, a local path's fix offers URLs too.
    local = refused(post(unbounded, chat(image_part(str(picture)))))
    assert "an http(s) URL" in local and "--allowed-media-dir" in local
    big = refused(post(bounded, chat(image_part(
        "data:image/png;base64," + base64.b64encode(bomb_png(6000, 6000)).decode()))))
    assert "--max-image-pixels" in big and "max_pixels" not in big
