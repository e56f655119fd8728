"""Which sampling values a generation uses when its caller leaves some out.

In order, as vLLM does it: the value the caller gave; the checkpoint's
``generation_config.json`` (its ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty``; ``do_sample: false`` means greedy); the entry point's own default
(greedy for the CLI and the Python API, OpenAI's for the server). ``load`` reads the
checkpoint's values once and keeps them in the processor's state
(``text.tokenization.processor_state(processor).sampling_defaults``, also readable as
``processor.sampling_defaults``);
every entry point resolves through ``resolve`` below.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from mlxvlm.sampling.ranges import SAMPLING, check

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# The CLI's and the Python API's defaults: greedy, no filters, no penalty.
LIBRARY_DEFAULTS: Mapping[str, Any] = {
    "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": None,
}
# OpenAI's: a request without a temperature samples at 1.
OPENAI_DEFAULTS: Mapping[str, Any] = {**LIBRARY_DEFAULTS, "temperature": 1.0}


@dataclass(frozen=True)
class CheckpointDefaults:
    """The sampling values a checkpoint's generation_config.json sets (only those)."""

    values: Mapping[str, Any] = field(default_factory=dict)
    source: str = GENERATION_CONFIG
    # Entries left out because they are outside the valid ranges, as "name=value".
    ignored: tuple[str, ...] = ()


NO_CHECKPOINT_DEFAULTS = CheckpointDefaults()


def read_checkpoint_defaults(model_path: str | Path) -> CheckpointDefaults:
    path = Path(model_path) / GENERATION_CONFIG
    if not path.is_file():
        return NO_CHECKPOINT_DEFAULTS
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return NO_CHECKPOINT_DEFAULTS
    return checkpoint_defaults_from(config if isinstance(config, dict) else {})


def checkpoint_defaults_from(config: Mapping[str, Any]) -> CheckpointDefaults:
    values: dict[str, Any] = {}
    ignored = []
    for name in FIELDS:
        value = config.get(name)
        if value is None:
            continue
        if check(name, value) is not None:
            ignored.append(f"{name}={value!r}")
            continue
        values[name] = value
    source = GENERATION_CONFIG
    if config.get("do_sample") is False:
        # transformers decodes greedily whatever the other fields say; the filters then
        # do nothing, the repetition penalty still applies.
        values = {"temperature": 0.0, **{k: v for k, v in values.items()
                                         if k == "repetition_penalty"}}
        source = f"{GENERATION_CONFIG}, do_sample false"
    if values.get("repetition_penalty") == 1.0:
        values["repetition_penalty"] = None  # 1 is no penalty: no processor to run
    return CheckpointDefaults(values, source, tuple(ignored))


@dataclass(frozen=True)
class ResolvedSampling:
    values: dict[str, Any]
    sources: dict[str, str]  # name -> "given", the checkpoint's file, or "default"

    def describe(self) -> str:
        """``temperature 0.0 (generation_config.json), top_p 1.0 (default), ...``"""
        return ", ".join(
            f"{name} {self.values[name]} ({self.sources[name]})" for name in FIELDS
        )


def resolve(
    given: Mapping[str, Any],
    checkpoint: CheckpointDefaults,
    fallback: Mapping[str, Any] = LIBRARY_DEFAULTS,
    fallback_name: str = "default",
) -> ResolvedSampling:
    """Each of ``FIELDS``: ``given`` unless None there, else the checkpoint's, else
    ``fallback``'s."""
    values, sources = {}, {}
    for name in FIELDS:
        if given.get(name) is not None:
            values[name], sources[name] = given[name], "given"
        elif name in checkpoint.values:
            values[name], sources[name] = checkpoint.values[name], checkpoint.source
        else:
            values[name], sources[name] = fallback[name], fallback_name
    return ResolvedSampling(values, sources)


def describe_checkpoint(checkpoint: CheckpointDefaults, fallback: Mapping[str, Any],
                        fallback_name: str) -> str:
    """For a log line at start-up: what requests that set nothing will get, and why."""
    text = resolve({}, checkpoint, fallback, fallback_name).describe()
    if checkpoint.ignored:
        text += f"; ignored from {GENERATION_CONFIG} (out of range): " + ", ".join(
            checkpoint.ignored)
    return text


def invalid_sampling_value(values: Mapping[str, Any]) -> str | None:
    """The first of ``values`` (sampling option names) outside its range, as a message."""
    for name, value in values.items():
        if value is not None and name in SAMPLING:
            problem = check(name, value)
            if problem is not None:
                return problem
    return None
