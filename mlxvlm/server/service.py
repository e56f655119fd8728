"""The server's side of the batching engine: admission, request preparation off the
event loop, and an async stream of each request's tokens.

Admission is counted from the moment a request is accepted until its last token (or its
cancellation): ``max_concurrency`` requests decode together and ``max_queue`` more may
wait or be prepared; beyond that the server answers 429 at once instead of letting work
pile up. A request whose client goes away is cancelled in the engine, which frees its
batch slot at the next step, or in its preparation, whose media decoding stops at the
next frame (``mlxvlm.preparation``: requests with media and text-only ones are prepared
by workers of their own).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import mlx.core as mx

from mlxvlm.batching import BatchAudio, BatchEngine, BatchStep, SamplingOptions
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.speech import SpeechRequest
from mlxvlm.generate.speculative import Speculation
from mlxvlm.media import MediaPolicy, PixelBudget, load_image, load_pdf
from mlxvlm.batching.disk_prefix_cache import DiskPrefixCache, checkpoint_fingerprint
from mlxvlm.batching.prefix_cache import PrefixCache, image_hash
from mlxvlm.preparation import PreparationPools, PreparationStats
from mlxvlm.prompt import PreparedInputs, prepare_inputs
from mlxvlm.server.config import MEDIA_OPTION_NAMES, ServerConfig
from mlxvlm.server.logprobs import TokenBytes
from mlxvlm.text.tokenization import tokenizer_of

logger = logging.getLogger(__name__)


T = TypeVar("T")


@dataclass
class PreparedRequest:
    inputs: PreparedInputs
    image_hashes: list[str] | None  # None: not eligible for prefix reuse
    cache_namespace: str | None = None  # prefixes are shared only within one namespace


# Why a request was refused for its grammar (``RequestCounters.refuse``).
REFUSAL_REASONS = ("grammar", "max_tokens")


@dataclass
class RequestCounters:
    """Totals for /metrics that the engine does not see."""

    accepted: int = 0
    rejected_busy: int = 0
    by_status: dict[int, int] | None = None
    # Requests refused with a 400 for passing a limit, by reason: a media limit's name
    # (an error's ``limit``, e.g. "max_video_decode_pixels"), "context_length", or for
    # their grammar: "grammar" (it cannot run: invalid, or more than llguidance's parser
    # allows), "max_tokens" (too few for a whole answer).
    refused: dict[str, int] = field(default_factory=dict)
    preparation: PreparationStats = field(default_factory=PreparationStats)

    def count(self, status: int) -> None:
        if self.by_status is None:
            self.by_status = {}
        self.by_status[status] = self.by_status.get(status, 0) + 1

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


def has_media(messages: list[dict]) -> bool:
    return any(isinstance(m["content"], list) and any(p["type"] != "text" for p in m["content"])
               for m in messages)


def disk_prefix_cache(model: Any, config: ServerConfig) -> DiskPrefixCache | None:
    """The prompt cache's disk tier (``--prompt-cache-dir``) for ``model``, keyed by the
    checkpoint and adapter it was loaded from."""
    if config.prompt_cache_dir is None:
        return None
    identity = checkpoint_fingerprint(getattr(model, "checkpoint_path", None),
                                      getattr(model, "adapter_path", None))
    try:
        return DiskPrefixCache(config.prompt_cache_dir,
                               int(config.prompt_cache_disk_gb * 1e9), identity)
    except OSError as e:
        raise MlxvlmError(f"cannot keep the prompt cache in --prompt-cache-dir "
                          f"{config.prompt_cache_dir!r}: {e.strerror or e}") from e


def speculation_of(config: ServerConfig, model: Any, processor: Any) -> Speculation | None:
    """The engine's speculative decoding from ``--draft-model`` (loaded here, refused
    if its tokenizer is not the model's; it takes the model's prompts as they are), ``--prompt-lookup-num-tokens`` or ``--mtp`` (the
    model's head, checked here)."""
    if config.mtp:
        if model.sharding is not None:
            raise MlxvlmError("--mtp does not run on a sharded model yet (its head would "
                              "run on rank 0 alone): leave it out under mlx.launch")
        model.multi_token_predictor()  # refuses a model without the head
        return Speculation(mtp=True, num_draft_tokens=config.num_draft_tokens)
    if config.prompt_lookup_num_tokens is not None:
        return Speculation(prompt_lookup_num_tokens=config.prompt_lookup_num_tokens)
    if config.draft_model is None:
        return None
    from mlxvlm.generate.drafters import load_draft

    return Speculation(draft_model=load_draft(config.draft_model, processor)[0],
                       num_draft_tokens=config.num_draft_tokens)


class GenerationService:
    def __init__(self, model: Any, processor: Any, config: ServerConfig, *,
                 counters: RequestCounters | None = None, pixels: PixelBudget | None = None):
        """``counters`` and ``pixels``: the server's, where several models' services
        share them (``models_registry``)."""
        self.model = model
        self.processor = processor
        self.config = config
        engine_class, prefix_cache = BatchEngine, None
        if model.sharding is not None:  # under mlx.launch: rank 0, whose passes all run
            from mlxvlm.batching.sharded_engine import ShardedEngine

            if config.prompt_cache_size > 0 or config.prompt_cache_dir is not None:
                logger.info("prompt-prefix reuse (--prompt-cache-size, --prompt-cache-dir) "
                            "is off on a sharded model: the other ranks do not mirror the "
                            "cache")
            engine_class = ShardedEngine
        elif config.prompt_cache_size > 0 or config.prompt_cache_dir is not None:
            prefix_cache = PrefixCache(max_entries=config.prompt_cache_size,
                                       disk=disk_prefix_cache(model, config))
        self.prefix_cache = prefix_cache
        self.engine = engine_class(
            model,
            processor,
            max_batch_size=config.max_concurrency,
            prefill_step_size=config.prefill_step_size,
            prefix_cache=prefix_cache,
            speculation=speculation_of(config, model, processor),
        )
        # Decoded pixels of each request and of all being prepared, charged from image
        # and video headers before decoding (see media.PixelBudget).
        self.pixels = pixels or PixelBudget(config.max_request_pixels, config.max_total_pixels)
        self.capacity = config.max_concurrency + config.max_queue
        self.vocab_size = len(tokenizer_of(processor))
        self.in_flight = 0  # only touched on the event loop
        self.counters = counters or RequestCounters()
        self.token_bytes = TokenBytes(self.engine.tokenizer)
        self.started_at = time.time()
        # Media decoding and the processor (tokenizer, image preprocessing) run here, so
        # that they neither block the event loop nor touch the engine's thread; text-only
        # requests have workers of their own, which media never hold.
        self._pools = PreparationPools(config.prepare_workers, config.prepare_workers,
                                       stats=self.counters.preparation)
        # A retrieval model's passes (embeddings, reranking) run in the media workers,
        # one request's at a time: MLX evaluates one graph per model at once here.
        self.model_lock = threading.Lock()

    def start(self) -> None:
        self.engine.start()

    def close(self) -> None:
        self.engine.close()
        self._pools.close()
        if self.prefix_cache is not None:
            self.prefix_cache.close()  # after the engine: its last entries are written

    # -- admission ----------------------------------------------------------------

    def try_admit(self) -> bool:
        if self.in_flight >= self.capacity:
            self.counters.rejected_busy += 1
            return False
        self.in_flight += 1
        self.counters.accepted += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1

    # -- preparation ----------------------------------------------------------------

    def media_policy(self) -> MediaPolicy:
        c = self.config
        return MediaPolicy(
            allow_remote=c.allow_remote_media,
            public_only=True,
            allow_local=c.allowed_media_dir is not None,
            allowed_dir=c.allowed_media_dir,
            timeout=c.media_timeout,
            max_image_bytes=c.max_image_bytes,
            max_image_pixels=c.max_image_pixels,
            max_video_frames=c.max_video_frames,
            max_video_decode_pixels=c.max_video_decode_pixels,
            max_decode_seconds=c.max_media_decode_seconds,
            names=MEDIA_OPTION_NAMES,
        )

    def _prepare(self, messages: list[dict], cache_namespace: str | None,
                 template_options: dict | None = None) -> PreparedRequest:
        with self.pixels.request():
            prepared = self._prepare_within_budget(messages, template_options)
        prepared.cache_namespace = cache_namespace
        return prepared

    def _prepare_within_budget(self, messages: list[dict],
                               template_options: dict | None = None) -> PreparedRequest:
        """Load the images (each is hashed by content, for prefix reuse), then render and
        process the conversation. Other media (video, audio) are left to
        ``prepare_inputs``, under the same policy."""
        policy = self.media_policy()
        images, other_media = [], False
        prepared_messages = []
        for message in messages:
            content = message["content"]
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part["type"] == "file":
                        pages = self._pdf_pages(part["file"]["file_data"], policy)
                        images.extend(pages)
                        parts.extend({"type": "image", "image": page} for page in pages)
                        continue
                    if part["type"] == "image_url":
                        images.append(load_image(part["image_url"]["url"], policy=policy))
                        part = {"type": "image", "image": images[-1]}
                    elif part["type"] != "text":
                        other_media = True
                    parts.append(part)
                message = {**message, "content": parts}
            prepared_messages.append(message)
        inputs = prepare_inputs(
            self.processor,
            prepared_messages,
            feature_names=getattr(self.model, "feature_names", None),
            media_policy=policy,
            chat_template_kwargs=template_options,
            max_context=self.model.max_context,
        )
        # MLX evaluates a graph only on the thread that built it (its streams are
        # per thread), so the inputs must be concrete before they reach the engine.
        mx.eval(inputs.input_ids, list(inputs.features.values()))
        # Prefix keys cover images only; a request with other media is not reused.
        hashes = None if other_media else [image_hash(image) for image in images]
        return PreparedRequest(inputs, hashes)

    def _pdf_pages(self, file_data: str, policy: MediaPolicy) -> list:
        """A file part's PDF as its pages' images, within --max-pdf-pages (each page
        charged to the pixel budget, and the client's leaving checked, page by page)."""
        if file_data[:5].lower() != "data:":  # bare base64, as some clients send it
            file_data = f"data:application/pdf;base64,{file_data}"
        return load_pdf(file_data, policy=policy, max_pages=self.config.max_pdf_pages,
                        pages_option="raise --max-pdf-pages")

    async def prepare(self, messages: list[dict], cache_namespace: str | None = None,
                      template_options: dict | None = None) -> PreparedRequest:
        """``cache_namespace`` (the client's API key id) confines prefix reuse to the
        requests of one client; ``template_options`` go to the chat template (tools,
        thinking). Cancelling the awaiting task (the client went away) stops the
        preparation at its next media frame."""
        job = self._pools.submit(
            functools.partial(self._prepare, messages, cache_namespace, template_options),
            media=has_media(messages))
        return await job.result()

    async def run_retrieval(self, work: Callable[[MediaPolicy], T], media: bool) -> T:
        """``work(policy)``: a retrieval request's inputs read under the server's media
        rules, and the model's passes over them (under ``model_lock``), in a preparation
        worker (off the event loop and the engine's thread), its images charged to the
        pixel budget; stopped at its next media frame if the awaiting task is cancelled."""
        def job() -> T:
            with self.pixels.request():
                return work(self.media_policy())

        return await self._pools.submit(job, media=media).result()

    # -- generation -----------------------------------------------------------------

    def submit(self, request: PreparedRequest, options: SamplingOptions,
               speech: SpeechRequest | None = None) -> "TokenStream":
        """Queue the request in the engine; raises at once if it cannot run (e.g. a
        prompt longer than the context). ``speech``: its answer spoken too."""
        return TokenStream(self.engine, request, options, speech)


class TokenStream:
    """A submitted request's steps, as an async iterator; ``cancel`` (or leaving the
    iteration early) stops it in the engine. A spoken request's stream holds its
    ``BatchAudio`` items too, in the order they were made, and ends with the one that
    carries its whole speech."""

    def __init__(self, engine: BatchEngine, request: PreparedRequest, options: SamplingOptions,
                 speech: SpeechRequest | None = None):
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False
        self._spoken = speech is not None

        def deliver(item: BatchStep | BatchAudio | BaseException) -> None:
            loop.call_soon_threadsafe(self._queue.put_nowait, item)

        self._handle = engine.submit(
            request.inputs, options, deliver, image_hashes=request.image_hashes,
            cache_namespace=request.cache_namespace, speech=speech,
        )

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> BatchStep | BatchAudio:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if isinstance(item, BatchAudio):
            self._done = item.speech is not None
        elif item.finish_reason is not None and not self._spoken:
            self._done = True
        return item

    def cancel(self) -> None:
        self._done = True
        self._handle.cancel()
