"""The chat UI on a live app (tiny Qwen2-VL checkpoint, 127.0.0.1, a free port): driven
through gradio_client, and once end to end in headless Chromium.

Every answer is checked against ``mlxvlm.generate`` on the conversation the model should
have seen, so a turn that loses an earlier image, keeps a failed turn or reuses a wrong
prefix shows up as a different text.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from gradio_client import Client, handle_file
from playwright.sync_api import expect, sync_playwright

import mlxvlm
from mlxvlm.ui.app import build_app, upload_media_options
from mlxvlm.ui.conversation import NOTICE_TITLE
from mlxvlm.ui.session import PREPARATION, ChatSession
from mlxvlm.ui.stats import FAILED_TURN
from av_media import coloured_frames, write_repeating_video, write_video
from tiny import make_image

WAIT_S = 30  # upper bound of every wait; the happy paths take well under a second each
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@dataclass
class LiveApp:
    url: str
    session: ChatSession
    model: Any
    processor: Any

    def client(self) -> Client:
        """A new browser-like session: its own conversation."""
        return Client(self.url, verbose=False)

    def expected(self, messages: list[dict], max_tokens: int) -> mlxvlm.GenerationOutput:
        return mlxvlm.generate(self.model, self.processor, messages, max_tokens=max_tokens)

    def assistant(self, text: str) -> dict:
        """An earlier answer as it goes back into the prompt: without the media placeholder
        strings the tiny random model emits now and then."""
        for placeholder in self.session.placeholders:
            text = text.replace(placeholder, "")
        return {"role": "assistant", "content": text}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def live(tiny_checkpoints):
    model, processor = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))
    session = ChatSession(
        model, processor, "tiny-qwen2-vl", media_options=upload_media_options()
    ).start()
    app = build_app(session).queue()
    app.launch(
        server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True
    )
    try:
        yield LiveApp(app.local_url, session, model, processor)
    finally:
        app.close()
        session.close()


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> list[Path]:
    directory = tmp_path_factory.mktemp("pictures")
    paths = []
    for seed, size in ((0, (80, 64)), (1, (64, 96))):
        path = directory / f"picture{seed}.png"
        make_image(*size, seed=seed).save(path)
        paths.append(path)
    return paths


def user(text: str, *images: Path) -> dict:
    return {
        "role": "user",
        "content": [{"type": "image", "image": str(p)} for p in images]
        + [{"type": "text", "text": text}],
    }


def ask(client: Client, text: str, *images: Path, max_tokens: int = 24, **controls):
    """Submit one turn; the job streams (reply, stats markdown) pairs."""
    settings = {"system": "", "temperature": 0.0, "top_p": 1.0, "max_tokens": max_tokens,
                "repetition_penalty": 1.0, "seed": -1, **controls}
    message = {"text": text, "files": [handle_file(str(p)) for p in images]}
    return client.submit(message, *settings.values(), api_name="/chat")


def answer(job) -> tuple[Any, str]:
    return job.result(timeout=WAIT_S)


def slowed(step: Callable[[], None], seconds: float) -> Callable[[], None]:
    """The engine's step at the pace of a real model on a CPU, so that a client on a
    loaded machine has time to press stop before the tiny model is done."""

    def slow_step() -> None:
        step()
        time.sleep(seconds)

    return slow_step


def test_streams_the_answer_to_an_image(live, pictures):
    job = ask(live.client(), "What is in the picture?", pictures[0], max_tokens=40)
    reply, stats = answer(job)

    expected = live.expected([user("What is in the picture?", pictures[0])], 40)
    assert reply == expected.text
    streamed = [out[0] for out in job.outputs() if isinstance(out[0], str) and out[0]]
    assert len(set(streamed)) > 1, "the answer arrived in one piece, not streamed"
    assert all(expected.text.startswith(s) for s in streamed)
    assert f"| prompt tokens | {expected.prompt_tokens} (0 reused) |" in stats
    assert f"| generated | {expected.generation_tokens} tokens" in stats


def test_follow_up_turns_keep_earlier_images_and_reuse_the_prefix(live, pictures):
    client = live.client()
    first, _ = answer(ask(client, "What is in the picture?", pictures[0]))

    # Text only: the first image stays in context; its turn is not computed again.
    second, stats = answer(ask(client, "What colour is it?"))
    conversation = [
        user("What is in the picture?", pictures[0]),
        live.assistant(first),
        user("What colour is it?"),
    ]
    expected = live.expected(conversation, 24)
    assert second == expected.text
    reused = int(stats.split("| prompt tokens | ")[1].split("(")[1].split(" reused")[0])
    assert reused >= live.expected(conversation[:1], 1).prompt_tokens

    # A second image in a later turn lands at its own place.
    third, _ = answer(ask(client, "And this one?", pictures[1]))
    conversation += [live.assistant(second), user("And this one?", pictures[1])]
    assert third == live.expected(conversation, 24).text


def test_a_video_is_answered_like_generate_and_kept_out_of_the_prefix_cache(live, tmp_path):
    clip = write_video(tmp_path / "clip.mp4", coloured_frames(6, 64, 48), fps=4)
    engine = live.session.engine
    reused_before = engine.stats.cached_prompt_tokens
    reply, stats = answer(ask(live.client(), "What happens?", clip))
    message = {"role": "user", "content": [{"type": "video", "video": str(clip)},
                                           {"type": "text", "text": "What happens?"}]}
    expected = live.expected([message], 24)
    assert reply == expected.text
    assert f"| prompt tokens | {expected.prompt_tokens} (0 reused) |" in stats
    assert engine.stats.cached_prompt_tokens == reused_before


def test_stop_closes_the_generator_and_the_model_stops(live, pictures, monkeypatch):
    engine = live.session.engine
    monkeypatch.setattr(engine, "step", slowed(engine.step, 0.01))
    cancelled, generated = engine.stats.requests_cancelled, engine.stats.generated_tokens
    # Seconds of work: greedy, the tiny model answers this prompt up to max_tokens.
    max_tokens = 900
    client = live.client()
    job = ask(client, "What is in the picture?", pictures[0], max_tokens=max_tokens)
    wait_until(
        lambda: sum(isinstance(o[0], str) and bool(o[0]) for o in job.outputs()) >= 3,
        "the first streamed tokens",
    )
    job.cancel()

    wait_until(
        lambda: engine.stats.requests_cancelled == cancelled + 1 and not engine.has_work,
        "the engine to drop the cancelled request",
    )
    assert engine.stats.generated_tokens - generated < max_tokens
    # The app answers the next turn, with the stopped answer in the conversation.
    reply, _ = answer(ask(client, "Shorter, please."))
    assert isinstance(reply, str) and reply


def test_errors_show_in_the_chat_and_the_app_keeps_working(live, pictures, tmp_path):
    client = live.client()
    hello, answered = answer(ask(client, "Hello?"))
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"this is not a PNG file")
    reply, stats = answer(ask(client, "What is this?", broken))
    assert reply["metadata"]["title"] == NOTICE_TITLE
    assert "broken.png" in reply["content"]
    # The panel still shows the earlier answer's figures, but says they are not this turn's.
    assert stats == f"{FAILED_TURN}\n\n{answered}"

    too_long = " ".join(["word"] * 1500)
    reply, stats = answer(ask(client, too_long))
    assert reply["metadata"]["title"] == NOTICE_TITLE
    assert "context" in reply["content"]
    assert stats == f"{FAILED_TURN}\n\n{answered}"

    # Same conversation: the failed turns are left out of what the model sees.
    reply, stats = answer(ask(client, "What is in the picture?", pictures[1]))
    conversation = [user("Hello?"), live.assistant(hello),
                    user("What is in the picture?", pictures[1])]
    assert reply == live.expected(conversation, 24).text
    assert FAILED_TURN not in stats and "prompt tokens" in stats


def test_answers_one_request_at_a_time(live, pictures):
    questions = ["What is in the picture?", "Describe it."]
    replies: dict[str, Any] = {}

    def chat(question: str) -> None:
        replies[question] = answer(ask(live.client(), question, pictures[0]))[0]

    threads = [threading.Thread(target=chat, args=(q,)) for q in questions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    for question in questions:
        assert replies[question] == live.expected([user(question, pictures[0])], 24).text


def test_a_conversations_video_does_not_hold_up_anothers_text(live, tmp_path, monkeypatch):
    """One conversation sends a video of 6,000 4096 x 4096 frames (the decoding bounds
    lifted for it: tens of CPU seconds); another's text chat is answered while it
    decodes, and closing the first turn stops its decoding."""
    policy = live.session.media_options
    monkeypatch.setattr(live.session, "media_options", dataclasses.replace(
        policy, max_video_decode_pixels=None, max_decode_seconds=None))
    video = write_repeating_video(tmp_path / "repeating.mp4", 4096, 4096, 6000)
    stats = PREPARATION.stats
    cancelled = stats.cancelled
    slow = ask(live.client(), "What happens?", video)
    wait_until(lambda: stats.preparing["media"] == 1, "the video's decoding")
    reply, _ = answer(ask(live.client(), "Hello?"))
    assert reply == live.expected([user("Hello?")], 24).text
    assert stats.preparing["media"] == 1  # answered while the video was still decoding
    slow.cancel()
    wait_until(lambda: stats.cancelled == cancelled + 1 and stats.preparing["media"] == 0,
               "the video's decoding to stop")


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("Chromium is not installed (Debian: apt-get install chromium)")
    return path


# Records the text of the newest answer at every change of the chat, to see it stream.
RECORD_ANSWERS = """() => {
    window.answerSnapshots = [];
    const chat = document.querySelector('#chat');
    new MutationObserver(() => {
        const answers = chat.querySelectorAll('[data-testid="bot"]');
        if (answers.length) {
            window.answerSnapshots.push(answers[answers.length - 1].textContent);
        }
    }).observe(chat, {subtree: true, childList: true, characterData: true});
}"""


def test_browser_chat_streams_an_answer_and_the_stop_button_stops(
    live, pictures, tmp_path, monkeypatch
):
    question = "What is in the picture?"
    expected = live.expected([user(question, pictures[1])], 64)
    engine = live.session.engine
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=chromium_path(),
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            browser.grant_permissions(
                ["clipboard-read", "clipboard-write"], origin=live.url.rstrip("/")
            )
            page = browser.new_page()
            page.set_default_timeout(WAIT_S * 1000)
            page.goto(live.url)
            textbox = page.locator("#message textarea")
            max_tokens = page.locator("#max-tokens input[type=number]")

            # Upload an image, ask, and watch the answer stream in.
            max_tokens.fill("64")
            max_tokens.press("Enter")
            page.locator("#message input[type=file]").set_input_files(str(pictures[1]))
            page.locator("#message img").wait_for()  # the upload's thumbnail
            page.evaluate(RECORD_ANSWERS)
            textbox.fill(question)
            textbox.press("Enter")
            page.locator("#answer-stats").get_by_text("prompt tokens").wait_for()
            expect(textbox).to_be_editable()
            page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
            print(f"screenshot: {tmp_path / 'chat.png'}")

            snapshots = [s for s in page.evaluate("window.answerSnapshots") if s.strip()]
            assert len(set(snapshots)) > 1, "the answer appeared in one piece, not streamed"
            # The copy button gives the answer's raw text (the page renders it as Markdown).
            page.locator('#chat button[aria-label="Copy message"]').last.click()
            assert page.evaluate("navigator.clipboard.readText()") == expected.text
            expect(page.locator('#chat [data-testid="user"] img')).to_have_count(1)

            # Clear, then stop a long answer (greedy, it would run to max_tokens).
            page.locator('#chat button[aria-label="Clear"]').click()
            expect(page.locator('#chat [data-testid="user"]')).to_have_count(0)
            monkeypatch.setattr(engine, "step", slowed(engine.step, 0.02))
            cancelled, generated = engine.stats.requests_cancelled, engine.stats.generated_tokens
            max_tokens.fill("900")
            max_tokens.press("Enter")
            page.locator("#message input[type=file]").set_input_files(str(pictures[0]))
            page.locator("#message img").wait_for()
            textbox.fill(question)
            textbox.press("Enter")
            expect(page.locator('#chat [data-testid="bot"]')).not_to_have_text("")
            page.locator('#message button[aria-label="Stop"]').click()
            wait_until(
                lambda: engine.stats.requests_cancelled == cancelled + 1 and not engine.has_work,
                "the engine to drop the stopped answer",
            )
            assert engine.stats.generated_tokens - generated < 900
            expect(page.locator('#message button[aria-label="Submit"]')).to_be_visible()
            expect(textbox).to_be_editable()
            page.screenshot(path=str(tmp_path / "stopped.png"), full_page=True)
        finally:
            browser.close()
