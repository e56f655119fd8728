"""``batch_generate``: many prompts through one ``BatchEngine``, stepped in this thread."""

from __future__ import annotations

import time
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.batching.engine import BatchEngine, BatchStep, Deliver
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.cache import CacheOptions
from mlxvlm.generate.keywords import GROUPED_KEYWORDS, build_options, fold_keywords
from mlxvlm.generate.stream import sampling_options
from mlxvlm.generate.text import GenerationOutput, OutputFolder
from mlxvlm.media.options import MediaOptions
from mlxvlm.prompt import prepare_inputs
from mlxvlm.retrieval.api import check_generates
from mlxvlm.sampling import SamplingOptions


def _per_prompt(name: str, values: Sequence[Any] | None, count: int) -> list[Any]:
    if values is None:
        return [None] * count
    if len(values) != count:
        raise MlxvlmError(f"got {count} prompts but {len(values)} {name} entries")
    return list(values)


# What batch_generate folds from its flat keywords: every SamplingOptions field (as
# before the options objects), the cache's and the media's.
BATCH_GROUPS = {
    "sampling": tuple(SamplingOptions.__dataclass_fields__),
    "cache": GROUPED_KEYWORDS["cache"],
    "media": GROUPED_KEYWORDS["media"],
}
BATCH_EXPLICIT = ("images", "videos", "audios", "max_batch_size", "prefill_step_size",
                  "system", *BATCH_GROUPS)


def batch_generate(
    model: nn.Module,
    processor: Any,
    prompts: Sequence[str | Sequence[dict]],
    images: Sequence[Any] | None = None,
    *,
    videos: Sequence[Any] | None = None,
    audios: Sequence[Any] | None = None,
    max_batch_size: int = 8,
    prefill_step_size: int = 2048,
    system: str | None = None,
    sampling: SamplingOptions | None = None,
    cache: CacheOptions | None = None,
    media: MediaOptions | None = None,
    **kwargs: Any,
) -> list[GenerationOutput]:
    """Generate answers for many prompts at once with continuous batching.

    ``prompts`` are strings or chat messages (as for ``generate``); ``images``,
    ``videos`` and ``audios`` give each prompt its media (None, one source, or a list;
    as ``generate``'s ``image``/``video``/``audio``), prepared by the same
    ``prepare_inputs``. ``sampling`` (a ``SamplingOptions``, used as given), ``cache``
    (``CacheOptions``: ``kv_bits`` needs ``max_batch_size=1``) and ``media``
    (``MediaOptions``: ``fps``, ``max_frames``, ``media_policy``) apply to every prompt;
    their fields may be given flat instead (``max_tokens=``, ``temperature=``,
    ``max_kv_size=``, ``fps=`` ...), as for ``generate``, but not both ways. Flat sampling
    values left out (or None) come from the checkpoint's generation_config.json. Greedy
    answers equal ``generate``'s for the same prompt. Returns one ``GenerationOutput``
    per prompt, in order.
    """
    check_generates(model)
    objects = dict(sampling=sampling, cache=cache, media=media)
    folded = fold_keywords("batch_generate", objects, kwargs, groups=BATCH_GROUPS, plain={},
                           explicit=BATCH_EXPLICIT)
    count = len(prompts)
    media_sources = list(zip(_per_prompt("image", images, count),
                             _per_prompt("video", videos, count),
                             _per_prompt("audio", audios, count)))
    options = build_options(SamplingOptions, sampling, folded.grouped["sampling"],
                            make=lambda **flat: sampling_options(processor, **flat))
    cache_options = build_options(CacheOptions, cache, folded.grouped["cache"])
    media = build_options(MediaOptions, media, folded.grouped["media"])
    engine = BatchEngine(
        model, processor, max_batch_size=max_batch_size, prefill_step_size=prefill_step_size,
        max_kv_size=cache_options.max_kv_size, kv_bits=cache_options.kv_bits,
        kv_group_size=cache_options.kv_group_size,
        quantized_kv_start=cache_options.quantized_kv_start,
    )
    folders = [OutputFolder() for _ in prompts]
    errors: list[BaseException] = []
    started = time.perf_counter()

    def collect(index: int) -> Deliver:
        def deliver(item: BatchStep | BaseException) -> None:
            if isinstance(item, BaseException):
                errors.append(item)
            else:
                folders[index].add(item)

        return deliver

    for index, (prompt, (image, video, audio)) in enumerate(zip(prompts, media_sources)):
        inputs = prepare_inputs(
            processor, prompt, image, video=video, audio=audio, system=system,
            feature_names=getattr(model, "feature_names", None),
            media_policy=media.media_policy, video_options=media.video_options(),
            max_context=model.max_context,
        )
        engine.submit(inputs, options, collect(index))
    while engine.has_work and not errors:
        engine.step()
    if errors:
        raise errors[0]
    elapsed = time.perf_counter() - started
    outputs = [folder.result() for folder in folders]
    total = sum(o.generation_tokens for o in outputs)
    for output in outputs:
        output.generation_tps = total / elapsed if elapsed > 0 else 0.0
        output.peak_memory = mx.get_peak_memory() / 1e9
    return outputs
