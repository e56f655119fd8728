"""``batch_generate``: many prompts through one ``BatchEngine``, stepped in this thread."""

from __future__ import annotations

import time
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.batching.engine import BatchEngine, BatchStep, Deliver
from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.cache import DEFAULT_QUANTIZED_KV_START
from mlxvlm.generate.stream import sampling_options
from mlxvlm.generate.text import GenerationOutput, OutputFolder
from mlxvlm.media import MediaPolicy
from mlxvlm.prompt import prepare_inputs
from mlxvlm.sampling import SamplingOptions


def _per_prompt(name: str, values: Sequence[Any] | None, count: int) -> list[Any]:
    if values is None:
        return [None] * count
    if len(values) != count:
        raise MlxvlmError(f"got {count} prompts but {len(values)} {name} entries")
    return list(values)


def batch_generate(
    model: nn.Module,
    processor: Any,
    prompts: Sequence[str | Sequence[dict]],
    images: Sequence[Any] | None = None,
    *,
    videos: Sequence[Any] | None = None,
    audios: Sequence[Any] | None = None,
    fps: float | None = None,
    max_frames: int | None = None,
    max_batch_size: int = 8,
    prefill_step_size: int = 2048,
    system: str | None = None,
    media_policy: MediaPolicy | None = None,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    **sampling: Any,
) -> list[GenerationOutput]:
    """Generate answers for many prompts at once with continuous batching.

    ``prompts`` are strings or chat messages (as for ``generate``); ``images``,
    ``videos`` and ``audios`` give each prompt its media (None, one source, or a list;
    as ``generate``'s ``image``/``video``/``audio``), prepared by the same
    ``prepare_inputs``. The sampling keywords are ``SamplingOptions``' (``max_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
    ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``top_logprobs``,
    ``seed``, ``stop`` ...) and apply to every prompt; the ones left out (or None) come
    from the checkpoint's generation_config.json, as for ``generate``. The cache options
    are ``BatchEngine``'s (``kv_bits`` needs ``max_batch_size=1``). Greedy answers equal
    ``generate``'s for the same prompt. Returns one ``GenerationOutput`` per prompt, in
    order.
    """
    count = len(prompts)
    media = list(zip(_per_prompt("image", images, count), _per_prompt("video", videos, count),
                     _per_prompt("audio", audios, count)))
    unknown = sorted(set(sampling) - set(SamplingOptions.__dataclass_fields__))
    if unknown:
        raise MlxvlmError(f"batch_generate got unknown sampling options: {', '.join(unknown)}")
    options = sampling_options(processor, **sampling)
    engine = BatchEngine(
        model, processor, max_batch_size=max_batch_size, prefill_step_size=prefill_step_size,
        max_kv_size=max_kv_size, kv_bits=kv_bits, kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
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

    video_options = {k: v for k, v in (("fps", fps), ("max_frames", max_frames)) if v is not None}
    for index, (prompt, (image, video, audio)) in enumerate(zip(prompts, media)):
        inputs = prepare_inputs(
            processor, prompt, image, video=video, audio=audio, system=system,
            feature_names=getattr(model, "feature_names", None),
            media_policy=media_policy, video_options=video_options,
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
