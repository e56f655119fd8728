"""The server's settings and its command line. Every default is the safe one: bound to
127.0.0.1, no remote fetches, no local files, bounded bodies, images and queues."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from mlxvlm.cli import (OneLineParser, add_model_arguments, add_speculation_arguments,
                        checkpoint_folders, ranged)
from mlxvlm.errors import MlxvlmError
from mlxvlm.media import (SERVED_MAX_DECODE_SECONDS, SERVED_MAX_VIDEO_DECODE_PIXELS,
                          SERVED_MAX_VIDEO_FRAMES, OptionNames)
from mlxvlm.sampling.ranges import NON_NEGATIVE, PORT, POSITIVE, SAMPLING, at_least
from mlxvlm.speech.duration import DEFAULT_MAX_SPEECH_SECONDS

MiB = 2**20
# What /v1/audio/speech says in one request unless --max-speech-input-chars says
# otherwise: OpenAI's limit on the text of one request.
MAX_SPEECH_INPUT_CHARS = 4096
# Byte and pixel limits: any bound a machine could hold.
_HUGE = 2**62

# The flags behind the media policy's options, for the fixes media errors suggest; a
# video's or audio's encoded size has no flag of its own (--max-body-bytes bounds what a
# request carries).
MEDIA_OPTION_NAMES = OptionNames(
    allow_remote="--allow-remote-media", allow_local="--allowed-media-dir",
    timeout="--media-timeout", max_image_bytes="--max-image-bytes",
    max_image_pixels="--max-image-pixels", max_video_frames="--max-video-frames",
    max_video_decode_pixels="--max-video-decode-pixels",
    max_decode_seconds="--max-media-decode-seconds", max_bytes=None, max_audio_seconds=None)


@dataclass
class ServerConfig:
    model_id: str  # the name clients put in "model" (and /v1/models lists)
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    api_keys: list[str] = field(default_factory=list)  # more keys; api_key joins them
    allowed_origins: list[str] = field(default_factory=list)
    # Host names answered beyond the loopback ones (see security.allowed_host_names).
    allowed_hosts: list[str] = field(default_factory=list)
    allow_remote_media: bool = False
    allowed_media_dir: str | None = None
    max_concurrency: int = 8
    max_queue: int = 32
    max_body_bytes: int = 32 * MiB
    max_image_bytes: int = 20 * MiB
    max_image_pixels: int = 25_000_000  # video frames too
    # Pages of one PDF a request may send (each becomes an image, charged to the pixel
    # budget); a longer document is refused before any page is rendered.
    max_pdf_pages: int = 16
    # What decoding one request's videos and audio may cost (see media.decode_work).
    max_video_frames: int = SERVED_MAX_VIDEO_FRAMES
    max_video_decode_pixels: int = SERVED_MAX_VIDEO_DECODE_PIXELS
    max_media_decode_seconds: float = SERVED_MAX_DECODE_SECONDS
    # Decoded pixels (images and video frames) of one request and of all requests being
    # prepared at once; None: sized to this machine's memory (media.default_pixel_budget).
    max_request_pixels: int | None = None
    max_total_pixels: int | None = None
    max_connections: int = 1000  # lowered below the open-file limit at start
    header_timeout: float = 10.0  # seconds for a request's headers
    body_timeout: float = 60.0  # seconds for a request's whole body
    max_buffered_body_bytes: int | None = None  # all bodies being read; None: 8 bodies
    media_timeout: float = 15.0
    max_tokens: int = 512  # when a request does not say
    prefill_step_size: int = 2048
    prompt_cache_size: int = 8  # finished conversations kept for prefix reuse; 0: off
    # Where finished conversations' caches are also kept across restarts (None: not on
    # disk), and the most gigabytes that folder may hold (least recently used out first).
    prompt_cache_dir: str | None = None
    prompt_cache_disk_gb: float = 10.0
    # Responses kept for previous_response_id, per API key, and their bytes per key and
    # for all keys (response_store: a key's least recently used make room, never
    # another key's); 0 responses: off
    max_stored_responses: int = 256
    max_stored_response_bytes: int = 128 * MiB
    max_total_stored_response_bytes: int = 512 * MiB
    prepare_workers: int = 2
    retry_after_seconds: int = 1
    # Speculative decoding (any max_concurrency; see BatchEngine's speculation).
    draft_model: str | None = None
    num_draft_tokens: int = 3
    prompt_lookup_num_tokens: int | None = None
    mtp: bool = False  # the model's own multi-token-prediction head drafts
    # Several models (models_registry): how many may be loaded at once (the least
    # recently used is unloaded to make room) and after how many unused seconds one is
    # unloaded (0: never).
    max_loaded_models: int = 1
    idle_unload_seconds: float = 0.0
    # A model in use stays loaded at least this long before another model's waiting
    # requests unload it: the bound on how often a busy server switches (an idle model
    # gives way at once; see models_registry).
    min_loaded_seconds: float = 10.0
    # A spoken answer keeps its talker and codec (and their caches) while it is spoken,
    # its batch slot's worth of work: the most seconds of audio one request may ask for (talker_max_frames above it: 400; left out: clamped to it),
    # and the most characters /v1/audio/speech says at once.
    max_speech_seconds: float = DEFAULT_MAX_SPEECH_SECONDS
    max_speech_input_chars: int = MAX_SPEECH_INPUT_CHARS
    # The models served: id -> local path or Hub repo (model_sources); None: model_id alone.
    model_sources: dict[str, str] | None = None

    def __post_init__(self) -> None:
        from mlxvlm.media import default_pixel_budget

        if self.model_sources is None:
            self.model_sources = {self.model_id: self.model_id}
        if self.api_key and self.api_key not in self.api_keys:
            self.api_keys = [self.api_key, *self.api_keys]
        self.api_key = self.api_key or (self.api_keys[0] if self.api_keys else None)
        per_request, total = default_pixel_budget()
        if self.max_total_pixels is None:
            self.max_total_pixels = max(total, self.max_request_pixels or 0)
        if self.max_request_pixels is None:
            self.max_request_pixels = min(per_request, self.max_total_pixels)
        if self.max_buffered_body_bytes is None:
            self.max_buffered_body_bytes = 8 * self.max_body_bytes
        for name in ("max_request_pixels", "max_total_pixels", "max_connections",
                     "max_buffered_body_bytes"):
            if getattr(self, name) < 1:
                raise MlxvlmError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_stored_response_bytes", "max_total_stored_response_bytes"):
            if getattr(self, name) < 1:
                raise MlxvlmError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_total_stored_response_bytes < self.max_stored_response_bytes:
            raise MlxvlmError(
                f"max_total_stored_response_bytes ({self.max_total_stored_response_bytes}) "
                f"must be at least max_stored_response_bytes "
                f"({self.max_stored_response_bytes})")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise MlxvlmError(
                f"max_buffered_body_bytes ({self.max_buffered_body_bytes}) must be at least "
                f"max_body_bytes ({self.max_body_bytes})")
        for name in ("header_timeout", "body_timeout", "max_media_decode_seconds",
                     "prompt_cache_disk_gb", "max_speech_seconds"):
            if not getattr(self, name) > 0:
                raise MlxvlmError(f"{name} must be above 0 seconds, got {getattr(self, name)}")
        for name in ("max_concurrency", "max_body_bytes", "max_image_bytes",
                     "max_image_pixels", "max_pdf_pages", "max_tokens", "prefill_step_size",
                     "prepare_workers", "max_speech_input_chars",
                     "max_loaded_models", "max_video_frames", "max_video_decode_pixels"):
            if getattr(self, name) < 1:
                raise MlxvlmError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_queue", "prompt_cache_size", "max_stored_responses",
                     "idle_unload_seconds", "min_loaded_seconds"):
            if getattr(self, name) < 0:
                raise MlxvlmError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prompt_cache_dir is not None and os.path.exists(self.prompt_cache_dir) \
                and not os.path.isdir(self.prompt_cache_dir):
            raise MlxvlmError(f"--prompt-cache-dir {self.prompt_cache_dir!r} is not a folder")
        drafters = [self.draft_model is not None, self.prompt_lookup_num_tokens is not None,
                    self.mtp]
        if sum(drafters) > 1:
            raise MlxvlmError("choose one of --draft-model, --prompt-lookup-num-tokens and "
                              "--mtp, not both")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m mlxvlm.server",
        description="OpenAI-compatible chat completions server with continuous batching.",
    )
    add_model_arguments(parser, several=True)
    parser.add_argument("--models-dir", default=None,
                        help="Also serve every checkpoint folder (with a config.json) in "
                        "this folder, named by the folder's name (default: none)")
    parser.add_argument("--max-loaded-models", type=ranged(at_least(1)), default=1,
                        help="Models loaded at once; a request for another unloads the "
                        "least recently used, after its requests in flight (default 1)")
    parser.add_argument("--idle-unload-seconds", type=ranged(NON_NEGATIVE), default=0.0,
                        help="Unload a model unused for this many seconds (default 0: "
                        "never)")
    parser.add_argument("--min-loaded-seconds", type=ranged(NON_NEGATIVE), default=10.0,
                        help="Seconds a loaded model in use keeps taking its requests "
                        "before requests for another model waiting for its place unload it "
                        "(after its answers in flight); one idle for a second gives way at "
                        "once")
    parser.add_argument("--served-model-name", default=None,
                        help="Model name clients use, for a single --model (default: the "
                        "--model value)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=ranged(PORT), default=8080, help="Port to listen on")
    parser.add_argument("--api-key", action="append", default=None,
                        help="Require 'Authorization: Bearer KEY'; repeat for several keys, "
                        "each with its own prompt cache (default: $MLXVLM_API_KEY)")
    parser.add_argument("--api-key-file", default=None,
                        help="Also accept the keys in this file, one a line (# comments; "
                        "default: none)")
    parser.add_argument("--allowed-hosts", action="append", default=[],
                        help="Host names to answer besides localhost, 127.0.0.1 and [::1], "
                        "comma-separated or repeated; '*': any (default: loopback names "
                        "on a loopback address, any name on other addresses)")
    parser.add_argument("--max-connections", type=ranged(at_least(1)), default=1000,
                        help="Open connections; more are answered 503 (lowered to fit the "
                        "open-file limit)")
    parser.add_argument("--header-timeout", type=ranged(POSITIVE), default=10.0,
                        help="Seconds a client has to send a request's headers (408 after)")
    parser.add_argument("--body-timeout", type=ranged(POSITIVE), default=60.0,
                        help="Seconds a client has to send a request's body (408 after)")
    parser.add_argument("--allowed-origins", nargs="+", default=[],
                        help="Origins allowed by CORS (default: none, CORS off)")
    parser.add_argument("--allow-remote-media", action="store_true",
                        help="Fetch http(s) media URLs (public addresses only)")
    parser.add_argument("--allowed-media-dir", default=None,
                        help="Allow local media paths inside this folder (default: none)")
    parser.add_argument("--max-concurrency", type=ranged(at_least(1)), default=8,
                        help="Requests decoded together in one batch")
    parser.add_argument("--max-queue", type=ranged(at_least(0)), default=32,
                        help="Requests waiting beyond those; more get 429")
    parser.add_argument("--max-body-bytes", type=ranged(at_least(1, _HUGE)), default=32 * MiB,
                        help="Largest request body (413 above)")
    parser.add_argument("--max-buffered-body-bytes", type=ranged(at_least(1, _HUGE)),
                        default=None,
                        help="Bytes of all request bodies being read at once; a body that "
                        "would pass it gets 503 (default: 8 times --max-body-bytes)")
    parser.add_argument("--max-image-bytes", type=ranged(at_least(1, _HUGE)), default=20 * MiB,
                        help="Largest encoded image")
    parser.add_argument("--max-image-pixels", type=ranged(at_least(1, _HUGE)), default=25_000_000,
                        help="Largest image or video frame width*height, checked before "
                        "decoding (default 25000000)")
    parser.add_argument("--max-pdf-pages", type=ranged(at_least(1)), default=16,
                        help="Pages of one PDF (a file part) a request may send; each is "
                        "rendered as an image (default 16)")
    parser.add_argument("--max-video-frames", type=ranged(at_least(1)),
                        default=SERVED_MAX_VIDEO_FRAMES,
                        help="Frames a video may hold (each one is decoded to sample from "
                        "them), from its container before decoding and counted while "
                        f"decoding (default {SERVED_MAX_VIDEO_FRAMES})")
    parser.add_argument("--max-video-decode-pixels", type=ranged(at_least(1, _HUGE)),
                        default=SERVED_MAX_VIDEO_DECODE_PIXELS,
                        help="Pixels of all video frames decoded for one request (frames x "
                        "width x height), from the containers before decoding and counted "
                        f"while decoding (default {SERVED_MAX_VIDEO_DECODE_PIXELS})")
    parser.add_argument("--max-media-decode-seconds", type=ranged(POSITIVE),
                        default=SERVED_MAX_DECODE_SECONDS,
                        help="CPU seconds decoding one request's videos and audio, each "
                        f"on one thread (default {SERVED_MAX_DECODE_SECONDS:g})")
    parser.add_argument("--max-request-pixels", type=ranged(at_least(1, _HUGE)), default=None,
                        help="Decoded pixels of all images and video frames of one request "
                        "(default: sized to memory, see docs/server.md)")
    parser.add_argument("--max-total-pixels", type=ranged(at_least(1, _HUGE)), default=None,
                        help="Decoded pixels of all requests being prepared at once "
                        "(default: sized to memory)")
    parser.add_argument("--media-timeout", type=ranged(POSITIVE), default=15.0,
                        help="Seconds for fetching one remote image")
    parser.add_argument("--max-tokens", type=ranged(SAMPLING["max_tokens"]), default=512,
                        help="New tokens for requests that do not say")
    parser.add_argument("--prefill-step-size", type=ranged(at_least(1)), default=2048,
                        help="Prompt tokens per prefill chunk")
    parser.add_argument("--max-speech-seconds", type=ranged(POSITIVE),
                        default=DEFAULT_MAX_SPEECH_SECONDS,
                        help="Seconds of audio one spoken answer may last (its talker "
                        "steps with the engine's every iteration): a request asking "
                        "for more frames gets 400, one that does not say is cut there "
                        f"(default {DEFAULT_MAX_SPEECH_SECONDS:g})")
    parser.add_argument("--max-speech-input-chars", type=ranged(at_least(1)),
                        default=MAX_SPEECH_INPUT_CHARS,
                        help="Characters of text /v1/audio/speech says in one request "
                        f"(400 above; default {MAX_SPEECH_INPUT_CHARS}, OpenAI's)")
    add_speculation_arguments(parser, " (with any --max-concurrency: the speculating requests "
                              "share one verify pass; a sharded model's server needs "
                              "--max-concurrency 1)")
    parser.add_argument("--prompt-cache-size", type=ranged(at_least(0)), default=8,
                        help="Finished conversations kept for prefix reuse (0: off)")
    parser.add_argument("--prompt-cache-dir", default=None,
                        help="Also keep finished conversations' caches in this folder (as "
                        "safetensors, per model, adapter and API key), so that a "
                        "conversation resumes from its cache after a restart (default: "
                        "none, memory only)")
    parser.add_argument("--prompt-cache-disk-gb", type=ranged(POSITIVE), default=10.0,
                        help="Most gigabytes --prompt-cache-dir may hold; the least recently "
                        "used files go first (default 10)")
    parser.add_argument("--max-stored-responses", type=ranged(at_least(0)), default=256,
                        help="Responses API answers kept for previous_response_id per API "
                        "key, the key's least recently used dropped first (0: none kept)")
    parser.add_argument("--max-stored-response-bytes", type=ranged(at_least(1, _HUGE)),
                        default=128 * MiB,
                        help="Bytes of stored responses per API key (an image or long "
                        "text counted once per key)")
    parser.add_argument("--max-total-stored-response-bytes", type=ranged(at_least(1, _HUGE)),
                        default=512 * MiB,
                        help="Bytes of stored responses of all keys; a response that does "
                        "not fit is not stored, no other key's is dropped")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="Least severe log messages shown")
    return parser


def model_sources(models: list[str], models_dir: str | None = None,
                  served_model_name: str | None = None) -> dict[str, str]:
    """The models a server answers with, by the id clients name them: each ``--model``
    value as given (``served_model_name`` renames a single one), then each folder of
    ``models_dir`` that holds a config.json, by the folder's name."""
    if served_model_name is not None and len(models) != 1:
        raise MlxvlmError("--served-model-name names one model; it cannot be used with "
                          f"{len(models)} --model values")
    sources: dict[str, str] = {}

    def add(model_id: str, path: str) -> None:
        if model_id in sources:
            raise MlxvlmError(f"two models are named {model_id!r}; each needs its own name")
        sources[model_id] = path

    for path in models:
        add(served_model_name or path, path)
    if models_dir is not None:
        for path in checkpoint_folders(models_dir):
            add(path.name, str(path))
    if not sources:
        raise MlxvlmError("no model to serve: give --model (one or more) or --models-dir")
    return sources


def read_key_file(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as file:
            lines = [line.strip() for line in file]
    except OSError as e:
        raise MlxvlmError(f"cannot read the API key file {path!r}: {e.strerror}") from e
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise MlxvlmError(f"the API key file {path!r} has no keys")
    return keys


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    keys = list(args.api_key or [])
    if not keys and os.environ.get("MLXVLM_API_KEY"):
        keys = [os.environ["MLXVLM_API_KEY"]]
    if args.api_key_file:
        keys += read_key_file(args.api_key_file)
    sources = model_sources(args.model or [], args.models_dir, args.served_model_name)
    return ServerConfig(
        model_id=next(iter(sources)),
        model_sources=sources,
        host=args.host,
        port=args.port,
        api_keys=[key for key in keys if key],
        allowed_origins=list(args.allowed_origins),
        allowed_hosts=[name for value in args.allowed_hosts for name in value.split(",")
                       if name.strip()],
        max_connections=args.max_connections,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_request_pixels=args.max_request_pixels,
        max_total_pixels=args.max_total_pixels,
        allow_remote_media=args.allow_remote_media,
        allowed_media_dir=args.allowed_media_dir,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        max_buffered_body_bytes=args.max_buffered_body_bytes,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        max_pdf_pages=args.max_pdf_pages,
        max_video_frames=args.max_video_frames,
        max_video_decode_pixels=args.max_video_decode_pixels,
        max_media_decode_seconds=args.max_media_decode_seconds,
        media_timeout=args.media_timeout,
        max_tokens=args.max_tokens,
        prefill_step_size=args.prefill_step_size,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_disk_gb=args.prompt_cache_disk_gb,
        max_stored_responses=args.max_stored_responses,
        max_stored_response_bytes=args.max_stored_response_bytes,
        max_total_stored_response_bytes=args.max_total_stored_response_bytes,
        draft_model=args.draft_model,
        num_draft_tokens=args.num_draft_tokens,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        mtp=args.mtp,
        max_loaded_models=args.max_loaded_models,
        idle_unload_seconds=args.idle_unload_seconds,
        min_loaded_seconds=args.min_loaded_seconds,
        max_speech_seconds=args.max_speech_seconds,
        max_speech_input_chars=args.max_speech_input_chars,
    )
