"""What generation needs from a processor, kept in one typed place of ours.

transformers' processor (or, for an mlx-lm text model used as a draft, a bare tokenizer)
is not ours, so ``load`` does not scatter attributes over it: it keeps one
``ProcessorState`` under ``STATE_ATTRIBUTE``, read through ``processor_state(processor)``
(built on first use for a processor the caller made by hand). ``tokenizer_of`` is the one
answer to "which object tokenizes" for a processor or a bare tokenizer.

Every path (``generate``, the batching engine, the server, the UI) gets its detokenizer
from ``generation_tokenizer(processor).detokenizer``: mlx-lm's TokenizerWrapper (which
hands out a fresh copy per sequence) carrying mlxvlm's ``StreamingDetokenizer``, whose
text is exactly ``tokenizer.decode(ids, skip_special_tokens=True)`` (see
mlxvlm/text/detokenizer.py; mlx-lm's own detokenizers show byte 0x00 as "Ā" and special or
out-of-vocabulary ids as "!"), except the family's answer markup: the special tokens a
family names in ``answer_markup_tokens`` (DeepSeek-OCR 2's ``<|ref|>``/``<|det|>``
grounding tags), which transformers' usage decodes with ``skip_special_tokens=False``
and which so reach the answer text of every entry point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable

from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import PreTrainedTokenizerBase

from mlxvlm.sampling.defaults import NO_CHECKPOINT_DEFAULTS, CheckpointDefaults
from mlxvlm.text.detokenizer import StreamingDetokenizer

# The one attribute mlxvlm sets on a processor it does not own.
STATE_ATTRIBUTE = "mlxvlm_state"


@dataclass
class ProcessorState:
    """What ``load`` learns about a processor once, for every generation path."""

    tokenizer: Any  # the processor's tokenizer (the processor itself when it is one)
    generation_tokenizer: TokenizerWrapper  # mlx-lm's wrapper with mlxvlm's detokenizer
    eos_token_ids: set[int]  # config.json, generation_config.json and the tokenizer's
    # generation_config.json's sampling values, for what a caller leaves out (none for a
    # processor ``load`` did not make)
    sampling_defaults: CheckpointDefaults = NO_CHECKPOINT_DEFAULTS
    # The special tokens of the family's answer markup, kept in every answer's text by
    # ``generation_tokenizer``'s detokenizer (none for a processor ``load`` did not make)
    answer_markup_ids: frozenset[int] = frozenset()


def tokenizer_of(processor: Any) -> Any:
    """The tokenizer behind ``processor``: a transformers processor's ``tokenizer``, or
    ``processor`` itself when it is a tokenizer (an mlx-lm text model's, a TokenizerWrapper
    mlx-lm loaded)."""
    if isinstance(processor, (PreTrainedTokenizerBase, TokenizerWrapper)):
        return processor
    return processor.tokenizer


def special_token_ids(tokenizer: Any, tokens: Iterable[str]) -> frozenset[int]:
    """The ids of those of ``tokens`` that are special tokens of ``tokenizer`` (the ones
    ``decode`` drops; a token that is plain text there needs no keeping)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = {token.content: i for i, token in added.items() if token.special}
    return frozenset(special[token] for token in tokens if token in special)


def attach_processor_state(processor: Any, eos_token_ids: set[int],
                           sampling_defaults: CheckpointDefaults,
                           answer_markup: Iterable[str] = ()) -> ProcessorState:
    """Keep ``load``'s findings on ``processor`` (replacing any earlier ones).
    ``answer_markup``: the family's ``answer_markup_tokens``."""
    tokenizer = tokenizer_of(processor)
    markup_ids = special_token_ids(tokenizer, answer_markup)
    detokenizer = (partial(StreamingDetokenizer, kept_token_ids=markup_ids) if markup_ids
                   else StreamingDetokenizer)
    state = ProcessorState(
        tokenizer=tokenizer,
        generation_tokenizer=TokenizerWrapper(tokenizer, detokenizer,
                                              eos_token_ids=set(eos_token_ids)),
        eos_token_ids=set(eos_token_ids),
        sampling_defaults=sampling_defaults,
        answer_markup_ids=markup_ids,
    )
    setattr(processor, STATE_ATTRIBUTE, state)
    return state


def processor_state(processor: Any) -> ProcessorState:
    """The ``ProcessorState`` ``load`` attached; for a processor built by hand, one made now
    from its tokenizer alone (its own end-of-sequence ids, no checkpoint defaults)."""
    state = getattr(processor, STATE_ATTRIBUTE, None)
    if state is None:
        tokenizer = tokenizer_of(processor)
        wrapper = TokenizerWrapper(tokenizer, StreamingDetokenizer)
        state = ProcessorState(tokenizer, wrapper, set(wrapper.eos_token_ids))
        setattr(processor, STATE_ATTRIBUTE, state)
    return state


def generation_tokenizer(processor: Any) -> TokenizerWrapper:
    """The processor's TokenizerWrapper (see ``processor_state``)."""
    return processor_state(processor).generation_tokenizer


def chat_template_owner(processor: Any) -> Any | None:
    """What renders the chat template: the processor when it has one (its
    chat_template.jinja), else its tokenizer when that has one (tokenizer_config.json's),
    else None."""
    for owner in (processor, tokenizer_of(processor)):
        if getattr(owner, "chat_template", None):
            return owner
    return None


def chat_template_text(processor: Any) -> str:
    """The chat template as one string (a template set by name, a dict, as JSON; "" for
    none), for reading its formats (thinking, tool calls)."""
    owner = chat_template_owner(processor)
    template = owner.chat_template if owner is not None else ""
    return template if isinstance(template, str) else json.dumps(template)
