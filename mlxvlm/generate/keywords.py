"""``stream_generate``'s keywords: the options objects it takes (``sampling``, ``cache``,
``media``, ``speculation``) and the flat names it has always taken (``temperature=``,
``max_kv_size=``, ``fps=``, ``draft_model=`` ...), each folded into its object, so that
old calls keep working and a new one can pass whole objects. A name nobody takes is a
``TypeError`` naming the closest one; a value given both ways is a ``TypeError`` too."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from mlxvlm.errors import MlxvlmError
from mlxvlm.generate.cache import CacheOptions
from mlxvlm.generate.speculative import SpeculationOptions
from mlxvlm.media.options import MediaOptions

# The flat names folded into each options object (SamplingOptions' own resolved later,
# against the checkpoint's generation_config.json). SamplingOptions' constraint,
# extra_processors and kept_token_ids are internal: json_schema= makes the constraint.
SAMPLING_KEYWORDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context_size",
    "presence_penalty", "frequency_penalty", "logit_bias", "top_logprobs", "seed", "stop",
)
GROUPED_KEYWORDS = {
    "sampling": SAMPLING_KEYWORDS,
    "cache": tuple(f.name for f in fields(CacheOptions)),
    "media": tuple(f.name for f in fields(MediaOptions)),
    "speculation": tuple(f.name for f in fields(SpeculationOptions)),
}
# Keywords that belong to no options object, with their defaults.
PLAIN_KEYWORDS: dict[str, Any] = {
    "system": None,
    "raw_prompt": False,
    "chat_template_kwargs": None,
    "json_schema": None,
    "sampler": None,
    "logits_processors": None,
    "prompt_progress_callback": None,
    "prefill_step_size": 2048,
}
# What stream_generate names in its signature, for the closest-name suggestion.
EXPLICIT_KEYWORDS = ("image", "video", "audio", "max_tokens", *GROUPED_KEYWORDS)


class UnknownKeywordError(MlxvlmError, TypeError):
    """A keyword the function does not take: a TypeError as Python's own, and an
    MlxvlmError as batch_generate's unknown options always were."""


@dataclass
class FoldedKeywords:
    """A call's keywords sorted out: each object's flat values (only those given), and
    every plain keyword (given or its default)."""

    grouped: dict[str, dict[str, Any]]
    plain: dict[str, Any]


def fold_keywords(function: str, objects: Mapping[str, Any], keywords: Mapping[str, Any], *,
                  groups: Mapping[str, tuple[str, ...]] = GROUPED_KEYWORDS,
                  plain: Mapping[str, Any] = PLAIN_KEYWORDS,
                  explicit: tuple[str, ...] = EXPLICIT_KEYWORDS) -> FoldedKeywords:
    """Sort ``keywords`` (the call's ``**kwargs``) by the object they belong to.
    ``objects``: the options objects the caller passed (None where not); ``groups``,
    ``plain`` and ``explicit``: what ``function`` takes (``stream_generate``'s by default),
    ``explicit`` only to suggest names."""
    owner = {name: group for group, names in groups.items() for name in names}
    grouped: dict[str, dict[str, Any]] = {group: {} for group in groups}
    plain_values = dict(plain)
    for name, value in keywords.items():
        if name in plain:
            plain_values[name] = value
        elif name in owner:
            group = owner[name]
            if objects.get(group) is not None:
                raise TypeError(f"{function}() got both {group}= and {name}=: set {name} on "
                                f"the {type(objects[group]).__name__} instead")
            grouped[group][name] = value
        else:
            valid = [*explicit, *plain, *owner]
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UnknownKeywordError(f"{function}() got an unexpected keyword argument '{name}'{hint}")
    return FoldedKeywords(grouped, plain_values)


def build_options(kind: type, given: Any, flat: Mapping[str, Any],
                  make: Callable[..., Any] | None = None) -> Any:
    """The caller's object as it is, or one made of the flat values (``make``, else the
    class), validated."""
    options = given if given is not None else (make or kind)(**flat)
    if not isinstance(options, kind):
        raise TypeError(f"expected a {kind.__name__}, got {type(options).__name__}")
    options.validate()
    return options
